"""Skip-softmax on the CPU backends (vanilla, torch) against the Triton kernels under the
interpreter (fp32): the same output and the same skipped/walked tile counts, for context and
generation rows, dense and selected, GQA and MLA; factor 0 is dense; a large factor really skips.

Tolerance: fp32, rtol = atol = 2e-5 (online softmax in exp2 vs exp; the skip decisions are
compared exactly, so the factors here keep every tile away from the decision boundary).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvsieve import SparseRuntimeParams
from kvsieve.sparse.backends import get_backend

from backends.harness import build, random_selection

TOL = dict(rtol=2e-5, atol=2e-5)


def peaked(md, q, geo, seed=0):
    """Make early keys dominate (scale the first 8 positions of every request), so that late tiles
    fall under the threshold; rewrites the layer's pool in place."""
    mgr = md.kv_cache_manager
    pool = mgr.pools[0]
    g = torch.Generator().manual_seed(seed)
    pool.copy_(torch.randn(pool.shape, generator=g))
    for b in md.block_ids_per_seq:
        first = b[0]
        if geo.kind == "mla":
            pool[first, :8] *= 6.0
        else:
            pool[first, 0, :, :8] *= 6.0  # HND: [blocks, 2, Hkv, P, D]
    return md, q * 2.0, geo


def run(backend, md, q, geo, params):
    return get_backend(backend).forward(q, md, 0, geo, params)


def assert_same(md, q, geo, params):
    ref = run("triton", md, q, geo, params)
    for name in ("vanilla", "torch"):
        res = run(name, md, q, geo, params)
        assert (res.skipped_tiles, res.walked_tiles) == (ref.skipped_tiles, ref.walked_tiles), name
        torch.testing.assert_close(res.out, ref.out, **TOL)
        finite = torch.isfinite(ref.lse)
        assert torch.equal(torch.isposinf(res.lse), torch.isposinf(ref.lse)), name
        torch.testing.assert_close(res.lse[finite], ref.lse[finite], **TOL)
    return ref


@pytest.mark.parametrize("factor", [1.0, 30.0, 1e3])
@pytest.mark.parametrize("group", [1, 4])
def test_dense_mixed_batch_matches_triton_tile_for_tile(factor, group):
    md, q, geo = peaked(*build(page=16, hq=2 * group, hkv=2, d=16, ctx_lens=[70, 150], gen_hist=[300, 5, 129],
                               seed=group))
    params = SparseRuntimeParams(threshold_scale_factor_context=factor, threshold_scale_factor_generation=factor)
    ref = assert_same(md, q, geo, params)
    assert ref.walked_tiles > 0


@pytest.mark.parametrize("block_size,page", [(1, 16), (4, 53), (16, 16)])
def test_selected_mixed_batch_matches_triton_tile_for_tile(block_size, page):
    md, q, geo = peaked(*build(page=page, hq=8, hkv=2, d=16, ctx_lens=[90], gen_hist=[400, 7, 200], seed=block_size))
    params = random_selection(md, 2, k=96 // block_size + 8, block_size=block_size, overshoot=1, seed=page)
    for factor in (10.0, 1e3):
        assert_same(md, q, geo, replace(params, threshold_scale_factor_context=factor,
                                        threshold_scale_factor_generation=factor))


def test_mla_matches_triton_tile_for_tile():
    md, q, geo = peaked(*build(page=16, hq=24, hkv=1, d=24, ctx_lens=[40], gen_hist=[260, 3], kind="mla", rank=16))
    assert_same(md, q, geo, SparseRuntimeParams(threshold_scale_factor_generation=100.0,
                                                threshold_scale_factor_context=5.0))
    sel = random_selection(md, 1, k=90, block_size=1)
    assert_same(md, q, geo, replace(sel, threshold_scale_factor_generation=100.0))


@pytest.mark.parametrize("backend", ["vanilla", "torch"])
def test_factor_zero_is_dense_and_large_factor_skips_only_small_mass(backend):
    md, q, geo = peaked(*build(page=16, hq=4, hkv=1, d=16, ctx_lens=[100], gen_hist=[500], seed=3))
    dense = run(backend, md, q, geo, None)
    zero = run(backend, md, q, geo, SparseRuntimeParams(threshold_scale_factor_generation=0.0))
    assert torch.equal(zero.out, dense.out) and (zero.skipped_tiles, zero.walked_tiles) == (0, 0)
    factor = 1e3
    res = run(backend, md, q, geo, SparseRuntimeParams(threshold_scale_factor_context=factor,
                                                       threshold_scale_factor_generation=factor))
    assert 0 < res.skipped_tiles < res.walked_tiles
    assert not torch.equal(res.out, dense.out)
    # each skipped tile's rows hold less than factor / kv_len of the row's running maximum per
    # position, so a row loses at most its skipped mass: lse can only drop, by the skipped share
    finite = torch.isfinite(dense.lse)
    assert bool((res.lse[finite] <= dense.lse[finite] + 1e-5).all())
    lost = 1 - torch.exp(res.lse[finite] - dense.lse[finite])  # attention mass the walk dropped
    assert float(lost.max()) > 0
    assert float(lost.max()) < 0.5, float(lost.max())


@pytest.mark.parametrize("backend", ["vanilla", "torch"])
def test_a_launch_table_that_splits_the_walk_is_refused(backend, monkeypatch):
    """On CUDA the kernels split the KV walk (split-K); the CPU backends do not, so they refuse
    rather than count different tiles. The table lookup is forced to sm90 to reach the branch."""
    from kvsieve.kernels.common import launch

    md, q, geo = build(page=16, hq=4, hkv=1, d=16, ctx_lens=[], gen_hist=[100])
    monkeypatch.setattr(launch, "detect_arch", lambda device: "sm90")
    with pytest.raises(ValueError, match="skip-softmax on CPU tensors only.*'triton'"):
        run(backend, md, q, geo, SparseRuntimeParams(threshold_scale_factor_generation=1.0))


def test_torch_chunked_rows_give_the_same_walk():
    """The torch backend's row chunks (sized by max_gather_bytes) do not change outputs or counts."""
    from kvsieve.sparse.backends.torch_backend import TorchBackend

    md, q, geo = peaked(*build(page=16, hq=4, hkv=2, d=16, ctx_lens=[30], gen_hist=[200, 90], seed=7))
    params = replace(random_selection(md, 2, k=40, block_size=1, seed=2), threshold_scale_factor_context=20.0,
                     threshold_scale_factor_generation=20.0)
    whole = TorchBackend().forward(q, md, 0, geo, params)
    chunked = TorchBackend(max_gather_bytes=1).forward(q, md, 0, geo, params)
    assert torch.equal(whole.out, chunked.out) and torch.equal(whole.lse, chunked.lse)
    assert (whole.skipped_tiles, whole.walked_tiles) == (chunked.skipped_tiles, chunked.walked_tiles)
    assert whole.walked_tiles > 0
