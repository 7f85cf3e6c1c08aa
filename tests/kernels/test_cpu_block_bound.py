"""block_select's selection by Quest's bound for many rows in one native call
(``kvsieve.kernels.block_bound``) against its naive twin (a row and head at a time, a stable sort):
two requests' rows, short rows (every block), forced blocks, several query groups and head dims."""
from __future__ import annotations

import shutil

import pytest
import torch

from kvsieve.kernels.block_bound.naive import block_bound_topk_naive
from kvsieve.kernels.block_bound.native import block_bound_topk_native, supports_block_bound
from kvsieve.kernels.common.native import NativeUnavailable

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler on this machine: the native kernel cannot build")


def _inputs(hkv, g, d, bs, prompts, seed):
    gen = torch.Generator().manual_seed(seed)
    units = -(-max(prompts) // bs)
    keys_min = torch.randn(len(prompts), units, hkv, d, generator=gen)
    bounds = torch.cat([keys_min, keys_min + torch.rand(len(prompts), units, hkv, d, generator=gen)], dim=-1)
    req = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(prompts)])
    lens = torch.cat([torch.arange(1, n + 1, dtype=torch.int32) for n in prompts])
    own_min = torch.randn(len(req), hkv, d, generator=gen)
    own = torch.cat([own_min, own_min + torch.rand(len(req), hkv, d, generator=gen)], dim=-1)
    q = torch.randn(len(req), hkv * g, d, generator=gen)
    return bounds, own, q, req, lens


@pytest.mark.parametrize("hkv,g,d,bs,k,init,local", [(3, 3, 64, 16, 8, 0, 1), (2, 4, 32, 8, 5, 1, 2),
                                                      (1, 1, 16, 4, 40, 0, 0), (4, 6, 128, 32, 3, 2, 1)])
def test_block_bound_matches_naive(hkv, g, d, bs, k, init, local):
    bounds, own, q, req, lens = _inputs(hkv, g, d, bs, [300, 77], seed=hkv + k)
    assert supports_block_bound(q, hkv)
    kw = dict(block_size=bs, k=k, init_units=init, local_units=local, sm_scale=d ** -0.5)
    got = block_bound_topk_native(bounds, own, q, req, lens, **kw)
    want = block_bound_topk_naive(bounds, own, q, req, lens, **kw)
    assert torch.equal(got, want)
    n_valid = (lens + bs - 1) // bs
    short = n_valid <= k  # every visible block, 0 .. n_valid - 1
    assert bool((got[short][:, :, 0] == 0).all()) and bool((got[~short] >= 0).all())
    if local:  # the own block (the last visible) is always taken
        assert bool((got[~short][:, :, -1] == (n_valid[~short] - 1)[:, None]).all())


def test_block_bound_refuses_past_its_shapes_and_without_library(monkeypatch):
    bounds, own, q, req, lens = _inputs(2, 2, 16, 8, [40, 9], seed=0)
    kw = dict(block_size=8, k=2, init_units=0, local_units=1, sm_scale=0.25)
    assert not supports_block_bound(q[:, :, :1].expand(-1, -1, 300), 2) and not supports_block_bound(q, 3)
    with pytest.raises(ValueError, match="sees past the 5 blocks"):
        block_bound_topk_native(bounds, own, q, req, lens, **{**kw, "block_size": 4})
    with pytest.raises(ValueError, match=r"a request in 0 .. 1 of bounds, got 49 entries in 0 .. 2"):
        block_bound_topk_native(bounds, own, q, req + (req == 1).int(), lens, **kw)
    with pytest.raises(RuntimeError, match=r"kvsieve_block_bound_topk returned -1 \(D=16, G=17"):
        block_bound_topk_native(bounds, own, q[:, :1].expand(-1, 34, -1), req, lens, **kw)
    monkeypatch.setenv("KVSIEVE_NATIVE", "0")
    with pytest.raises(NativeUnavailable, match="KVSIEVE_NATIVE=0"):
        block_bound_topk_native(bounds, own, q, req, lens, **kw)
