"""paged_prefill: dense tiled path (causal, chunked) and sparse gather path (interpreter).

Tolerances: see conftest."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import (F32_TOL, GOLDEN_TOL, assert_close_lse, golden_attention,
                      make_block_table, make_cache, make_selection)
from kvsieve.kernels.paged_prefill import naive
from kvsieve.kernels.paged_prefill.plan import select_prefill_path
from kvsieve.kernels.paged_prefill.triton import paged_prefill


def _chunked(new_tokens, cached, page, hkv, group, d=64, layout="NHD", seed=0):
    """Requests with ``cached[i]`` context tokens and ``new_tokens[i]`` query tokens."""
    g = torch.Generator().manual_seed(seed)
    tok, kv_lens = [], []
    for r, (n, c) in enumerate(zip(new_tokens, cached)):
        tok += [r] * n
        kv_lens += [c + i + 1 for i in range(n)]
    max_len = max(kv_lens)
    bt = make_block_table(len(new_tokens), max_len, page,
                          len(new_tokens) * (-(-max_len // page) + 1) + 2, seed)
    k, v = make_cache(int(bt.max()) + 1, hkv, page, d, layout=layout, seed=seed)
    q = torch.randn(len(tok), hkv * group, d, generator=g)
    return (q, k, v, bt, torch.tensor(tok, dtype=torch.int32),
            torch.tensor(kv_lens, dtype=torch.int32))


@pytest.mark.parametrize("new,cached,page,group", [
    ([20], [30], 16, 1), ([5, 17, 3], [0, 40, 7], 53, 4), ([9, 1, 12], [3, 60, 0], 1, 16),
    ([33], [0], 64, 2)])
def test_dense_prefill(new, cached, page, group):
    q, k, v, bt, tok, kv_lens = _chunked(new, cached, page, 2 if group < 16 else 1, group)
    assert select_prefill_path(None) == "dense_tiled"
    o, l = paged_prefill(q, k, v, bt, tok, kv_lens)
    ro, rl = naive.paged_prefill(q, k, v, bt, tok, kv_lens)
    go, gl = golden_attention(q, k, v, bt, tok, kv_lens, None, None, 1, 1 / 8)
    torch.testing.assert_close(o, ro, **F32_TOL)
    assert_close_lse(l, rl, **F32_TOL)
    torch.testing.assert_close(o.double(), go, **GOLDEN_TOL)
    assert_close_lse(l, gl, **GOLDEN_TOL)


@pytest.mark.parametrize("block", [1, 4])
def test_sparse_prefill(block):
    q, k, v, bt, tok, kv_lens = _chunked([6, 4], [50, 10], 16, 2, 4)
    idx, off = make_selection(kv_lens.tolist(), 2, block, 8)
    assert select_prefill_path(idx) == "sparse_gather"
    o, l = paged_prefill(q, k, v, bt, tok, kv_lens, idx, off, block, num_splits=2)
    ro, rl = naive.paged_prefill(q, k, v, bt, tok, kv_lens, idx, off, block, num_splits=2)
    go, gl = golden_attention(q, k, v, bt, tok, kv_lens, idx, off, block, 1 / 8)
    torch.testing.assert_close(o, ro, **F32_TOL)
    torch.testing.assert_close(o.double(), go, **GOLDEN_TOL)
    assert_close_lse(l, gl, **GOLDEN_TOL)


def test_dense_prefill_rejects_splits():
    q, k, v, bt, tok, kv_lens = _chunked([3], [0], 16, 1, 1)
    with pytest.raises(ValueError, match="num_splits"):
        paged_prefill(q, k, v, bt, tok, kv_lens, num_splits=2)


def test_prefill_zero_length_token_row():
    q, k, v, bt, tok, kv_lens = _chunked([4], [2], 16, 1, 2)
    kv_lens[1] = 0  # a token that may see nothing
    o, l = paged_prefill(q, k, v, bt, tok, kv_lens, sm_scale=1 / math.sqrt(64))
    assert torch.all(o[1] == 0) and torch.all(torch.isposinf(l[1]))
    go, gl = golden_attention(q, k, v, bt, tok, kv_lens, None, None, 1, 1 / 8)
    torch.testing.assert_close(o.double(), go, **GOLDEN_TOL)
