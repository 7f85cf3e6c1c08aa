"""The batched torch backend (CPU default) against the per-request Vanilla golden.

Tolerance: fp32 everywhere, rtol = atol = 1e-5 (same math, different reduction order).
"""
from __future__ import annotations

import pytest
import torch

from kvsieve import SparseRuntimeParams
from kvsieve.sparse.backends import default_backend, get_backend
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


def _ragged(md, hkv: int, block_size: int, seed: int, duplicate: bool = False) -> SparseRuntimeParams:
    """Per-token selections of different lengths (0..5 units, ascending); with ``duplicate`` every
    non-empty segment repeats its first unit (only possible with validation off)."""
    g = torch.Generator().manual_seed(seed)
    segs, offs = [], [0]
    for n in md.token_kv_lens.tolist():
        units = -(-n // block_size)
        k = int(torch.randint(0, min(units, 5) + 1, (1,), generator=g))
        rows = [torch.randperm(units, generator=g)[:k].sort().values for _ in range(hkv)]
        if duplicate and k:
            rows = [torch.cat([r[:1], r]) for r in rows]
        segs.append(torch.stack(rows) if rows[0].numel() else torch.zeros(hkv, 0, dtype=torch.int64))
        offs.append(offs[-1] + segs[-1].shape[1])
    return SparseRuntimeParams(sparse_attn_indices=torch.cat(segs, 1).to(torch.int32),
                               sparse_attn_offsets=torch.tensor(offs, dtype=torch.int32),
                               sparse_attn_indices_block_size=block_size)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("block_size", [1, 4])
def test_selections_of_different_lengths_per_token(backend, block_size):
    md, q, geo = build(page=4, hq=4, hkv=2, d=16, ctx_lens=[11], gen_hist=[30, 9], seed=block_size)
    params = _ragged(md, 2, block_size, seed=block_size)
    params.validate(num_kv_heads=2, num_query_tokens=md.num_tokens, kv_lens=md.token_kv_lens)
    assert params.sparse_attn_offsets.diff().unique().numel() > 1
    compare(backend, md, q, geo, params, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", ["vanilla", "torch", "triton"])
def test_a_duplicate_index_is_attended_once_in_every_backend(backend):
    """With validation off nothing rejects a repeated index: every backend reads the selection as a set."""
    md, q, geo = build(page=4, hq=4, hkv=2, d=16, ctx_lens=[11], gen_hist=[30, 9], seed=2)
    dup = _ragged(md, 2, 1, seed=5, duplicate=True)
    with pytest.raises(ValueError, match="strictly ascending"):
        dup.validate(num_kv_heads=2, num_query_tokens=md.num_tokens, kv_lens=md.token_kv_lens)
    once = _ragged(md, 2, 1, seed=5)
    res = get_backend(backend).forward(q, md, 0, geo, dup)
    ref = get_backend("vanilla").forward(q, md, 0, geo, once)
    torch.testing.assert_close(res.out, ref.out, rtol=2e-5, atol=2e-5)
    finite = torch.isfinite(ref.lse)
    torch.testing.assert_close(res.lse[finite], ref.lse[finite], rtol=2e-5, atol=2e-5)
    assert torch.equal(res.attended, get_backend(backend).forward(q, md, 0, geo, once).attended)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("block_size,page", [(1, 16), (4, 16), (64, 16), (16, 53), (4, 1)])
def test_attended_counts_what_the_golden_reads(layout, block_size, page):
    """The torch backend counts ``attended`` from its own gather masks; it equals the Vanilla
    golden's count on dense rows, padded/overshooting selections, repeats and phase-narrowed params."""
    md, q, geo = build(page=page, hq=4, hkv=2, d=16, ctx_lens=[20, 7], gen_hist=[150, 64, 5], seed=block_size,
                       layout=layout)
    torch_b, vanilla = get_backend("torch"), get_backend("vanilla")
    sel = random_selection(md, 2, k=6, block_size=block_size, overshoot=2, seed=page)
    dup = _ragged(md, 2, block_size, seed=page, duplicate=True)
    gen_only = SparseRuntimeParams(sparse_attn_indices=sel.sparse_attn_indices,
                                   sparse_attn_offsets=sel.sparse_attn_offsets,
                                   sparse_attn_indices_block_size=block_size, selected_phases=frozenset({"generation"}))
    for params in (None, sel, dup, gen_only):
        got = torch_b.forward(q, md, 0, geo, params).attended
        assert got.dtype == torch.int64 and got.device.type == "cpu"
        assert torch.equal(got, vanilla.forward(q, md, 0, geo, params).attended)
    assert not torch.equal(torch_b.forward(q, md, 0, geo, sel).attended, torch_b.forward(q, md, 0, geo, None).attended)
