"""``kvsieve.eval.mass_recall`` measures each selector's own choice (run through kvsieve's Engine
by ``selection_driver.kept_positions``); its figures on a fixed input equal each selector's rule
worked out here by hand (exact top-k mass, sinks + recent window, top pages by mass, Quest's bound
on bf16 summaries, block_select's fp32 bound, the indexer's top logits)."""
from __future__ import annotations

import math

import pytest
import torch

from kvsieve.sparse.calibration import LayerCapture
from kvsieve.eval.mass_recall import bound_terms, group_mass, mean_interval, recall_config, window_recall
from kvsieve.selectors.dsa.projections import IndexerProjections
from kvsieve.sparse.knobs import KnobError
from recall_table import make_input

LENGTH, ROWS, PAGE = 512, torch.arange(508, 512), 16
REDUCTION_FACTORS = (4, 16)


@pytest.fixture(scope="module")
def fixed():
    d = make_input(prompt_len=508, decode_steps=4, num_kv_heads=2, group_size=3, head_dim=32, seed=1)
    torch.manual_seed(1)
    hidden = torch.randn(LENGTH, 48).bfloat16()
    proj = IndexerProjections(48, 4, 16, 8)
    return LayerCapture(hidden, d.dq, torch.cat([d.k, d.dk]), 32 ** -0.5), proj


def _top(score: torch.Tensor, k: int) -> list[int]:
    return torch.sort(score, descending=True, stable=True).indices[:k].tolist()


def _page_bound(q: torch.Tensor, keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[Hq, pages]``: sum_d max(q_d min_d, q_d max_d) over each page's min/max (rounded to ``dtype``)
    of ``keys [n, D]`` (the last page partial), ``q [Hq, D]``."""
    pages = [keys[p: p + PAGE] for p in range(0, keys.shape[0], PAGE)]
    kmin = torch.stack([x.amin(0) for x in pages]).to(dtype).float()
    kmax = torch.stack([x.amax(0) for x in pages]).to(dtype).float()
    return torch.maximum(q[:, None] * kmin, q[:, None] * kmax).sum(-1)


def hand_kept(name: str, cap: LayerCapture, r: int, t: int, budget: int) -> list[list[int]]:
    """Per KV head, the positions ``name`` keeps for row ``r`` at position ``t`` (by hand)."""
    keys, q = cap.k[: t + 1], cap.q[r]
    hkv, n = keys.shape[1], t + 1
    g = q.shape[0] // hkv
    mass = group_mass(q, keys, cap.scale)
    n_pages, pages = -(-n // PAGE), budget // PAGE

    def tokens(page_ids: list[int]) -> list[int]:
        return [p for i in page_ids for p in range(i * PAGE, min((i + 1) * PAGE, n))]

    out = []
    for h in range(hkv):
        qh = q[h * g: (h + 1) * g]
        if name == "oracle_topk":
            out.append(_top(mass[h], budget))
        elif name == "streaming":
            out.append(list(range(4)) + list(range(n - (budget - 4), n)))
        elif name == "oracle_page":
            page_mass = torch.stack([mass[h, i * PAGE: (i + 1) * PAGE].sum() for i in range(n_pages)])
            out.append(tokens(_top(page_mass, pages)))
        elif name in ("quest", "block_select"):
            if name == "quest":
                score = torch.softmax(_page_bound(qh, keys[:, h], torch.bfloat16) * cap.scale, -1).mean(0)
            else:
                score = (_page_bound(qh, keys[:, h], torch.float32) * cap.scale).amax(0)
            score[-1] = float("inf")  # the newest page / the last block
            out.append(tokens(_top(score, pages)))
    return out


def test_figures_equal_each_rule_by_hand(fixed):
    cap, proj = fixed
    got = window_recall({0: cap}, ROWS, REDUCTION_FACTORS, {0: proj}, LENGTH)
    for d in REDUCTION_FACTORS:
        budget = math.ceil(LENGTH / d)  # whole pages of 16 at both densities
        for name in got:
            if name == "dsa":
                continue
            want = []
            for r, t in enumerate(ROWS.tolist()):
                mass = group_mass(cap.q[r], cap.k[: t + 1], cap.scale)
                kept = hand_kept(name, cap, r, t, budget)
                want.append(sum(float(mass[h, kept[h]].sum()) for h in range(2)) / 2)
            assert got[name][d][0] == pytest.approx(sum(want) / len(want), abs=1e-6), (name, d)
        assert 0 < got["dsa"][d][0] <= got["oracle_topk"][d][0] + 1e-6  # its choice: the next test
    assert got["oracle_page"][4][0] < got["oracle_topk"][4][0]  # page granular: below the token oracle


def test_dsa_keeps_a_top_k_of_the_index_logits(fixed):
    from kvsieve.eval.selection_driver import kept_positions

    cap, proj = fixed
    with torch.no_grad():
        kk = proj.keys(cap.hidden, torch.arange(LENGTH)).bfloat16().float()
        qq, w = proj.queries(cap.hidden[ROWS], ROWS)
        logits = torch.einsum("rh,rhs->rs", w, torch.einsum("rhd,sd->rhs", qq, kk).relu())
    budget = LENGTH // 4
    kept = kept_positions(recall_config("dsa", LENGTH, 4, projections=proj), cap.q, cap.k, 508, cap.scale,
                          hidden=cap.hidden, projections=proj)
    for r, t in enumerate(ROWS.tolist()):
        s = logits[r, : t + 1]
        kth = torch.sort(s, descending=True).values[budget - 1]
        chosen = kept[r, 0].nonzero().flatten()
        assert torch.equal(kept[r, 0], kept[r, 1])  # one set for every KV head
        assert chosen.numel() == budget and bool((s[chosen] >= kth).all())
        assert set((s > kth).nonzero().flatten().tolist()) <= set(chosen.tolist())


def test_refusals_and_interval(fixed):
    cap, proj = fixed
    with pytest.raises(ValueError, match=r"unknown selector 'dsa' \('dsa' needs projections\)"):
        recall_config("dsa", 512, 4)
    with pytest.raises(ValueError, match="unknown selector 'quset'"):
        recall_config("quset", 512, 4)
    with pytest.raises(KnobError, match=r"quest\.budget: reduction factor 64 at 256 tokens asks 4 tokens, less than "
                                        r"one unit of 16"):
        recall_config("quest", 256, 64)
    with pytest.raises(ValueError, match="rows must be consecutive"):
        window_recall({0: cap}, torch.tensor([500, 511]), (4,), None, LENGTH)
    with pytest.raises(ValueError, match="needs at least 2 values, got 1"):
        mean_interval([0.5])
    mean, half = mean_interval([0.4, 0.6])  # t(1) = 12.706, sd = 0.1414, n = 2
    assert mean == pytest.approx(0.5) and half == pytest.approx(12.706 * 0.141421356 / 2 ** 0.5, rel=1e-4)


def test_bound_terms_split_the_bound_exactly_and_rank_a_planted_page():
    """center + spread is Quest's bound (by hand, fp32); a page whose keys align with the query
    gets the top mass and the bound's top page."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 8), torch.randn(64, 1, 8) * 0.1
    k[16:32] += 2 * q[0] / q[0].norm()
    bound = _page_bound(q, k[:, 0], torch.float32)  # [G, pages]
    kp = k.view(4, 16, 1, 8)
    c, h = (kp.amax(1) + kp.amin(1)) / 2, (kp.amax(1) - kp.amin(1)) / 2
    torch.testing.assert_close(bound, (c[:, 0] @ q.T + h[:, 0] @ q.abs().T).T)
    terms = bound_terms(q, k, 1.0, 16, reduction_factor=4)
    assert terms["top_overlap"] == 1.0 and terms["rho_bound"] > 0


def test_command_on_tiny_random_measures_and_reuses_its_captures(tmp_path):
    import json

    from kvsieve.eval.mass_recall import main

    args = ["--model", "tiny-random", "--length", "256", "--texts", "2", "--rows", "2", "--reduction-factors", "4", "16",
            "--captures", str(tmp_path / "caps")]
    lines: list[str] = []
    assert main(args + ["--json", str(tmp_path / "a.json")], lines.append) == 0
    assert len(list((tmp_path / "caps").glob("*.pt"))) == 2
    assert any(line.startswith("| oracle_topk | ") for line in lines)
    assert main(args + ["--json", str(tmp_path / "b.json")], lines.append) == 0
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert a["per_window"] == b["per_window"]
    for window in a["per_window"]:
        for d in ("4", "16"):
            ceiling = window["oracle_topk"][d]
            assert all(window[n][d][layer] <= ceiling[layer] + 1e-6 for n in window for layer in ceiling)
