"""sparse_gqa_decode: kernel vs naive reference vs independent float64 golden (interpreter).

Tolerances: see conftest (fp32 1e-5 kernel/reference, 2e-5 vs golden; fp16 2e-3)."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import (F16_TOL, F32_TOL, GOLDEN_TOL, assert_close_lse, golden_attention,
                      make_block_table, make_cache, make_selection)
from kvsieve.kernels.sparse_gqa_decode import naive
from kvsieve.kernels.sparse_gqa_decode.triton import sparse_gqa_decode

# (page_size, block_size, group, batch, hkv, head_dim, layout, n_sel)
CASES = [
    (1, 1, 1, 1, 2, 64, "HND", 40),
    (16, 4, 2, 3, 2, 64, "NHD", 12),
    (53, 64, 4, 3, 1, 128, "HND", 2),
    (64, 128, 8, 1, 1, 64, "NHD", 2),
    (16, 1, 16, 17, 1, 64, "HND", 24),
    (53, 1, 2, 17, 2, 64, "NHD", 30),
    (16, 4, 8, 3, 1, 96, "HND", 10),  # non-power-of-two head_dim (64 + 32 parts)
]


def _setup(page, batch, hkv, group, d, layout, dtype=torch.float32, max_len=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv_lens = torch.randint(1, max_len + 1, (batch,), generator=g).to(torch.int32)
    kv_lens[0] = max_len
    bt = make_block_table(batch, max_len, page, num_blocks=batch * (-(-max_len // page) + 1) + 2,
                          seed=seed)
    k, v = make_cache(int(bt.max()) + 1, hkv, page, d, layout=layout, dtype=dtype, seed=seed)
    q = torch.randn(batch, hkv * group, d, generator=g).to(dtype)
    return q, k, v, bt, torch.arange(batch, dtype=torch.int32), kv_lens


@pytest.mark.parametrize("page,block,group,batch,hkv,d,layout,n_sel", CASES)
def test_sparse_matches_reference_and_golden(page, block, group, batch, hkv, d, layout, n_sel):
    max_len = 300 if block >= 64 else 200
    q, k, v, bt, tok, kv_lens = _setup(page, batch, hkv, group, d, layout, max_len=max_len)
    idx, off = make_selection(kv_lens.tolist(), hkv, block, n_sel)
    outs = []
    for splits in (1, 3):
        o, l = sparse_gqa_decode(q, k, v, bt, tok, kv_lens, idx, off, block, num_splits=splits)
        ro, rl = naive.sparse_gqa_decode(q, k, v, bt, tok, kv_lens, idx, off, block,
                                         num_splits=splits)
        torch.testing.assert_close(o, ro, **F32_TOL)
        assert_close_lse(l, rl, **F32_TOL)
        outs.append((o, l))
    go, gl = golden_attention(q, k, v, bt, tok, kv_lens, idx, off, block, 1 / math.sqrt(d))
    for o, l in outs:  # split-K on and off both equal the golden
        torch.testing.assert_close(o.double(), go, **GOLDEN_TOL)
        assert_close_lse(l, gl, **GOLDEN_TOL)


@pytest.mark.parametrize("page,group,batch", [(53, 4, 3), (1, 2, 1), (64, 16, 17)])
def test_dense_matches_golden(page, group, batch):
    q, k, v, bt, tok, kv_lens = _setup(page, batch, 1, group, 64, "NHD", max_len=150)
    o, l = sparse_gqa_decode(q, k, v, bt, tok, kv_lens, sm_scale=0.1, num_splits=2)
    ro, rl = naive.sparse_gqa_decode(q, k, v, bt, tok, kv_lens, sm_scale=0.1, num_splits=2)
    go, gl = golden_attention(q, k, v, bt, tok, kv_lens, None, None, 1, 0.1)
    torch.testing.assert_close(o, ro, **F32_TOL)
    torch.testing.assert_close(o.double(), go, **GOLDEN_TOL)
    assert_close_lse(l, gl, **GOLDEN_TOL)


def test_empty_padding_and_beyond_context_rows():
    q, k, v, bt, tok, kv_lens = _setup(16, 4, 2, 4, 64, "HND", max_len=100)
    kv_lens[2] = 30
    rows = [[], [-1, -1, -1], [30, 31, 99], [0, 5, 99, -1]]  # empty, padding, beyond, mixed
    off = torch.tensor([0, 0, 3, 6, 10], dtype=torch.int32)
    idx = torch.tensor([sum(rows, [])] * 2, dtype=torch.int32)
    tok = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    for splits in (1, 2):
        o, l = sparse_gqa_decode(q, k, v, bt, tok, kv_lens, idx, off, num_splits=splits)
        assert torch.all(o[:3] == 0) and torch.all(torch.isposinf(l[:3]))
        go, gl = golden_attention(q, k, v, bt, tok, kv_lens, idx, off, 1, 1 / 8)
        torch.testing.assert_close(o.double(), go, **GOLDEN_TOL)
        assert_close_lse(l, gl, **GOLDEN_TOL)


def test_fp16_matches_golden():
    q, k, v, bt, tok, kv_lens = _setup(16, 3, 2, 4, 64, "NHD", dtype=torch.float16)
    idx, off = make_selection(kv_lens.tolist(), 2, 4, 12)
    o, l = sparse_gqa_decode(q, k, v, bt, tok, kv_lens, idx, off, 4, num_splits=2)
    assert o.dtype == torch.float16 and l.dtype == torch.float32
    go, gl = golden_attention(q, k, v, bt, tok, kv_lens, idx, off, 4, 1 / 8)
    torch.testing.assert_close(o.double(), go, **F16_TOL)
    assert_close_lse(l, gl, **F16_TOL)


def test_separate_head_dim_v():
    g = torch.Generator().manual_seed(3)
    bt = make_block_table(2, 80, 16, 20)
    k, v = make_cache(20, 2, 16, 64, dv=32)
    q = torch.randn(2, 4, 64, generator=g)
    kv_lens = torch.tensor([80, 41], dtype=torch.int32)
    tok = torch.tensor([0, 1], dtype=torch.int32)
    o, l = sparse_gqa_decode(q, k, v, bt, tok, kv_lens)
    go, gl = golden_attention(q, k, v, bt, tok, kv_lens, None, None, 1, 1 / 8)
    assert o.shape == (2, 4, 32)
    torch.testing.assert_close(o.double(), go, **GOLDEN_TOL)
