from __future__ import annotations

import math

import pytest
import torch

from kvsieve.eval.metrics import (digit_prefix_match, fidelity_metrics, kl_divergence, mean_ci95, string_match_all,
                                  string_match_part)


def test_string_matches():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert string_match_all("only 123", ["123", "456"]) == 0.5
    assert string_match_part("only 123", ["123", "456"]) == 1.0
    assert string_match_all("ABCDE, fghij", ["abcde", "FGHIJ"]) == 1.0
    with pytest.raises(ValueError, match="answers"):
        string_match_all("x", [])


def test_digit_prefix_match():
    assert digit_prefix_match(" 1234567.", "1234567") == 1.0
    assert digit_prefix_match("it is 1239999", "1234567") == pytest.approx(3 / 7)
    assert digit_prefix_match("no digits", "1234567") == 0.0


def test_mean_ci95():
    m, lo, hi = mean_ci95([1.0, 1.0, 0.0, 1.0])
    assert m == 0.75 and 0.0 < lo < 0.75 < hi <= 1.0
    assert mean_ci95([1.0]) [0] == 1.0 and mean_ci95([1.0])[2] == 1.0
    m, lo, hi = mean_ci95([0.5, 0.7])
    assert lo < 0.6 < hi
    assert all(math.isnan(x) for x in mean_ci95([]))


def _dense_out(q, k, v, scale):
    hq, hkv = q.shape[1], k.shape[1]
    kk, vv = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    p = torch.softmax(torch.einsum("nhd,lhd->nhl", q, kk) * scale, -1)
    return torch.einsum("nhl,lhd->nhd", p, vv), p


def test_fidelity_metrics_full_and_partial():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 8), torch.randn(20, 2, 8), torch.randn(20, 2, 8)
    out, p = _dense_out(q, k, v, 0.35)
    full = torch.ones(2, 1, 20, dtype=torch.bool)
    m = fidelity_metrics(q, k, v, full, out, 0.35)
    assert m["mass_recall"] == pytest.approx(1.0) and m["rel_error"] < 1e-5 and m["topk_overlap"] == 1.0
    # keep exactly the top-5 group mass per KV head: overlap 1, recall = their mass
    group = p.view(1, 2, 2, 20).sum(2)[0]  # [Hkv, L]
    mask = torch.zeros(2, 1, 20, dtype=torch.bool)
    for h in range(2):
        mask[h, 0, group[h].topk(5).indices] = True
    m = fidelity_metrics(q, k, v, mask, out, 0.35)
    assert m["topk_overlap"] == 1.0
    expected = (p.view(1, 2, 2, 20) * mask.view(2, 1, 1, 20).transpose(0, 1).float()).sum(-1).mean()
    assert m["mass_recall"] == pytest.approx(float(expected), rel=1e-5)
    assert fidelity_metrics(q, k, v, mask, out * 1.1, 0.35)["rel_error"] == pytest.approx(0.1, rel=1e-4)


def test_kl():
    a = torch.randn(3, 10)
    assert kl_divergence(a, a) == pytest.approx(0.0, abs=1e-6)
    assert kl_divergence(a, a.flip(-1)) > 0
