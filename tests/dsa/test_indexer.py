"""Indexer logits: the Triton kernel (interpreter) against its reference, and the reference
against a float64 loop written from the formula; FP8 power-of-two quantization."""
from __future__ import annotations

import pytest
import torch

from kvsieve.kernels.dsa_indexer import naive
from kvsieve.kernels.dsa_indexer.quant import quantize_pow2_fp8

F32_TOL = dict(atol=1e-4, rtol=1e-4)


def _inputs(t, h, d, s_kv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g)
    k = torch.randn(s_kv, d, generator=g)
    w = torch.rand(t, h, generator=g) * d ** -0.5
    ks = None
    if dtype == torch.float8_e4m3fn:
        k, ks = quantize_pow2_fp8(k)
        q, q_scale = quantize_pow2_fp8(q)
        w = w * q_scale
    else:
        q, k = q.to(dtype), k.to(dtype)
    return q, k, ks, w


def _golden(q, k_rows, scale, w):
    """float64 loop: sum_h w * relu(q . k) * scale per (row, key)."""
    out = torch.zeros(len(k_rows), max((len(r) for r in k_rows), default=0), dtype=torch.float64)
    for t, rows in enumerate(k_rows):
        for j, (key, sc) in enumerate(zip(rows, scale[t])):
            out[t, j] = sum(float(w[t, h]) * max(float(q[t, h].double() @ key.double()), 0.0)
                            for h in range(q.shape[1])) * sc
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("h,d", [(4, 32), (6, 40)])
def test_prefill_kernel_matches_reference(dtype, h, d):
    from kvsieve.kernels.dsa_indexer import triton as kernel

    q, k, ks, w = _inputs(5, h, d, 300, dtype)
    start = torch.tensor([0, 0, 10, 10, 37], dtype=torch.int32)
    lens = torch.tensor([1, 7, 3, 263, 0], dtype=torch.int32)
    want = naive.indexer_logits_prefill(q, k, ks, w, start, lens, 300)
    got = kernel.indexer_logits_prefill(q, k, ks, w, start, lens, 300)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = ~torch.isinf(want)
    torch.testing.assert_close(got[fin], want[fin], **F32_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("page", [16, 7])
def test_decode_kernel_matches_reference(dtype, page):
    from kvsieve.kernels.dsa_indexer import triton as kernel

    g = torch.Generator().manual_seed(3)
    nb, d, h = 40, 32, 4
    cache = torch.randn(nb, page, d, generator=g)
    scales = None
    if dtype == torch.float8_e4m3fn:
        cache, scales = quantize_pow2_fp8(cache)
    else:
        cache = cache.to(dtype)
    q, _, _, w = _inputs(4, h, d, 1, torch.float8_e4m3fn if dtype == torch.float8_e4m3fn else dtype, seed=4)
    bt = (torch.randperm(nb - 1, generator=g)[:2 * 19].view(2, 19) + 1).to(torch.int32)
    tok = torch.tensor([0, 1, 1, 0], dtype=torch.int32)
    lens = torch.tensor([130, 1, 57, 0], dtype=torch.int32)
    want = naive.indexer_logits_decode(q, cache, scales, w, bt, tok, lens, 133)
    got = kernel.indexer_logits_decode(q, cache, scales, w, bt, tok, lens, 133)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = ~torch.isinf(want)
    torch.testing.assert_close(got[fin], want[fin], **F32_TOL)
    # the reference against the formula, with plain per-position block-table lookups
    rows = [[cache[bt[tok[t], p // page], p % page].float() for p in range(int(lens[t]))] for t in range(4)]
    sc = [[1.0 if scales is None else float(scales[bt[tok[t], p // page], p % page]) for p in range(int(lens[t]))]
          for t in range(4)]
    gold = _golden(q.float(), rows, sc, w)
    for t in range(4):
        n = int(lens[t])
        torch.testing.assert_close(want[t, :n].double(), gold[t, :n], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("shared", [True, False])
def test_prefill_reference_in_row_chunks_matches_formula(monkeypatch, dtype, shared):
    """The reference scores rows in cache-sized chunks; with a chunk of a few rows (so every
    case crosses chunk boundaries) it still equals the float64 formula, both when all rows read
    the same keys (one request, its shared-keys path) and when their first keys differ."""
    monkeypatch.setattr(naive, "KEY_CHUNK_ELEMS", 3 * 50 * 4)  # ~3 rows of width 50 per chunk
    q, k, ks, w = _inputs(9, 4, 32, 60, dtype, seed=7)
    start = torch.zeros(9, dtype=torch.int32) if shared else torch.tensor([0, 2, 2, 5, 9, 9, 9, 1, 0],
                                                                         dtype=torch.int32)
    lens = torch.tensor([1, 4, 9, 17, 50, 23, 0, 33, 48], dtype=torch.int32)
    got = naive.indexer_logits_prefill(q, k, ks, w, start, lens, 50)
    rows = [[k[int(start[t]) + j].float() for j in range(int(lens[t]))] for t in range(9)]
    sc = [[1.0 if ks is None else float(ks[int(start[t]) + j]) for j in range(int(lens[t]))] for t in range(9)]
    gold = _golden(q.float(), rows, sc, w)
    for t in range(9):
        n = int(lens[t])
        torch.testing.assert_close(got[t, :n].double(), gold[t, :n], atol=1e-4, rtol=1e-4)
        assert bool(torch.isinf(got[t, n:]).all())


def test_decode_reference_in_row_chunks_equals_one_chunk(monkeypatch):
    """Decode rows scored a few at a time give the same logits, bit for bit, as all rows at once."""
    g = torch.Generator().manual_seed(8)
    cache = torch.randn(30, 8, 32, generator=g).bfloat16()
    q, _, _, w = _inputs(7, 4, 32, 1, torch.bfloat16, seed=9)
    bt = (torch.randperm(29, generator=g)[:2 * 14].view(2, 14) + 1).to(torch.int32)
    tok = torch.tensor([0, 1, 1, 0, 1, 0, 0], dtype=torch.int32)
    lens = torch.tensor([110, 1, 57, 0, 112, 64, 3], dtype=torch.int32)
    whole = naive.indexer_logits_decode(q, cache, None, w, bt, tok, lens, 112)
    monkeypatch.setattr(naive, "KEY_CHUNK_ELEMS", 2 * 112 * 32)  # two rows per chunk
    assert torch.equal(naive.indexer_logits_decode(q, cache, None, w, bt, tok, lens, 112), whole)


def test_pow2_fp8_quantization():
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(5)) * torch.logspace(-3, 3, 64).unsqueeze(1)
    x[5] = 0
    xq, s = quantize_pow2_fp8(x)
    assert xq.dtype == torch.float8_e4m3fn and s.shape == (64,)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two
    assert float(s[5]) == 1.0 and bool((xq[5].float() == 0).all())
    assert bool((xq.float().abs().amax(1) <= 448).all())
    # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormal step 2^-9 in units of the scale
    err = (xq.float() * s[:, None] - x).abs()
    assert bool((err <= x.abs() / 16 + s[:, None] * 2.0 ** -9).all())


def test_argument_errors():
    q, k, ks, w = _inputs(2, 4, 32, 10, torch.float32)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="weights"):
        naive.indexer_logits_prefill(q, k, ks, w[:, :3], lens, lens, 10)
    with pytest.raises(ValueError, match="k_len"):
        naive.indexer_logits_prefill(q, k, ks, w, lens, lens.long(), 10)
    with pytest.raises(ValueError, match="head_dim"):
        naive.indexer_logits_prefill(q, k[:, :16], ks, w, lens, lens, 10)
