"""The batched torch backend (CPU default) against the per-request Vanilla golden.

Tolerance: fp32 everywhere, rtol = atol = 1e-5 (same math, different reduction order).
"""
from __future__ import annotations

import pytest
import torch

from kvsieve.sparse.backends import default_backend
from kvsieve.sparse.selection import attended_counts

from .harness import build, compare, random_selection


@pytest.mark.parametrize("page", [1, 16, 53])
@pytest.mark.parametrize("group", [1, 4, 16])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_dense_mixed_batch(page, group, layout):
    md, q, geo = build(page=page, hq=2 * group, hkv=2, d=16, ctx_lens=[9, 30], gen_hist=[40, 3, 77], layout=layout)
    compare("torch", md, q, geo, None)


@pytest.mark.parametrize("block_size", [1, 4, 64])
@pytest.mark.parametrize("page", [1, 16, 53])
def test_sparse_selection_with_padding_and_overshoot(block_size, page):
    md, q, geo = build(page=page, hq=8, hkv=2, d=16, ctx_lens=[20], gen_hist=[150, 64, 5], seed=block_size)
    params = random_selection(md, 2, k=6, block_size=block_size, overshoot=2, seed=page)
    compare("torch", md, q, geo, params)


def test_all_padding_rows_and_mla():
    md, q, geo = build(page=16, hq=16, hkv=1, d=24, ctx_lens=[7], gen_hist=[33, 90], kind="mla", rank=16)
    params = random_selection(md, 1, k=8, block_size=1, pad_frac=0.0)
    compare("torch", md, q, geo, params)
    empty = random_selection(md, 1, k=4, block_size=1, pad_frac=1.0)
    out, lse = compare("torch", md, q, geo, empty)
    assert torch.count_nonzero(out) == 0 and bool(torch.isposinf(lse).all())


def test_small_gather_budget_chunks_tokens_identically():
    from kvsieve.sparse.backends.torch_backend import TorchBackend
    md, q, geo = build(page=16, hq=4, hkv=2, d=16, ctx_lens=[50], gen_hist=[70])
    a = TorchBackend().forward(q, md, 0, geo, None)
    b = TorchBackend(max_gather_bytes=1).forward(q, md, 0, geo, None)  # one token per chunk
    torch.testing.assert_close(a.out, b.out, rtol=1e-6, atol=1e-6)  # padding width differs per chunk
    torch.testing.assert_close(a.lse, b.lse, rtol=1e-6, atol=1e-6)


def test_default_backend_per_device_and_counts():
    assert default_backend("cpu") == "torch"
    with pytest.raises(ValueError, match="no default backend"):
        default_backend("meta")
    md, q, geo = build(page=4, hq=2, hkv=1, d=8, ctx_lens=[], gen_hist=[10])
    params = random_selection(md, 1, k=2, block_size=4, pad_frac=0.0, seed=3)
    exact = attended_counts(params, md.token_kv_lens, 1)
    assert int(exact.sum()) <= 8
