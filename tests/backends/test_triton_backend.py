"""The triton backend (kernels under the Triton interpreter on CPU) against the Vanilla golden.

Tolerance: fp32 inputs, rtol = atol = 2e-5 (online softmax vs one-shot softmax).
"""
from __future__ import annotations

import pytest
import torch

from kvsieve import SparseRuntimeParams
from kvsieve.sparse.backends import get_backend

from .harness import build, compare, random_selection

TOL = dict(rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("page,group", [(1, 1), (16, 4), (53, 8)])
def test_dense_mixed_batch_prefill_and_decode(page, group):
    md, q, geo = build(page=page, hq=2 * group, hkv=2, d=16, ctx_lens=[9, 21], gen_hist=[40, 3])
    compare("triton", md, q, geo, None, **TOL)


@pytest.mark.parametrize("block_size,page", [(1, 16), (4, 53), (64, 16)])
def test_sparse_mixed_batch(block_size, page):
    md, q, geo = build(page=page, hq=8, hkv=2, d=16, ctx_lens=[12], gen_hist=[150, 5, 70], seed=block_size)
    params = random_selection(md, 2, k=5, block_size=block_size, overshoot=1, seed=page)
    compare("triton", md, q, geo, params, **TOL)
    res = get_backend("triton").forward(q, md, 0, geo, params)
    assert res.paths == {"context": "sparse_gather", "generation": "decode_gather"}


def test_mla_sparse_and_empty_rows():
    md, q, geo = build(page=16, hq=16, hkv=1, d=24, ctx_lens=[], gen_hist=[33, 90, 1], kind="mla", rank=16)
    compare("triton", md, q, geo, random_selection(md, 1, k=8, block_size=1), **TOL)
    out, lse = compare("triton", md, q, geo, random_selection(md, 1, k=4, block_size=1, pad_frac=1.0), **TOL)
    assert bool(torch.isposinf(lse).all()) and torch.count_nonzero(out) == 0


def test_effective_tokens_round_to_pages():
    md, q, geo = build(page=16, hq=2, hkv=1, d=8, ctx_lens=[], gen_hist=[100])
    sel = torch.tensor([[[0, 40, 99]]], dtype=torch.int32)  # three tokens in three different pages
    params = SparseRuntimeParams.from_topk(sel)
    assert int(get_backend("vanilla").effective_attended_tokens(params, md, geo).sum()) == 3
    # pages 0, 2 and 6 (the last, holding positions 96..100) -> 16 + 16 + 5
    assert int(get_backend("triton").effective_attended_tokens(params, md, geo).sum()) == 37


def test_skip_softmax_counts_and_zero_factor_is_dense():
    md, q, geo = build(page=16, hq=4, hkv=1, d=16, ctx_lens=[], gen_hist=[300], seed=5)
    backend = get_backend("triton")
    res = backend.forward(q, md, 0, geo, None)
    dense, _ = res.out, res.lse
    res = backend.forward(q, md, 0, geo, SparseRuntimeParams(threshold_scale_factor_generation=0.0))
    off, _ = res.out, res.lse
    assert torch.equal(dense, off) and (res.skipped_tiles, res.walked_tiles) == (0, 0)  # counters: skip phases only
    res = backend.forward(q, md, 0, geo, SparseRuntimeParams(threshold_scale_factor_generation=1.0))
    assert res.walked_tiles == 5  # ceil(301 positions / 64-position tiles), one program (token, KV head)
