"""The torch backend's run gather (contiguous pool rows through ``index_select``) against Vanilla.

HND and MLA caches take the run path; the run length is ``gcd(selection block size, page)``
(dense: the page), so sub-page, whole-page and multi-page selections each exercise a different
row shape. NHD caches take the per-token path; both must agree with the golden.
"""
from __future__ import annotations

import pytest
import torch

from kvsieve import SparseRuntimeParams
from kvsieve.sparse.backends import TorchBackend, get_backend

from .harness import build, compare, random_selection


@pytest.mark.parametrize("block_size", [1, 4, 16, 32, 48])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_runs_match_vanilla(block_size, layout):
    md, q, geo = build(page=16, hq=8, hkv=2, d=16, ctx_lens=[37], gen_hist=[200, 16, 3], layout=layout,
                       seed=block_size)
    params = random_selection(md, 2, k=5, block_size=block_size, overshoot=1, seed=block_size + 1)
    compare("torch", md, q, geo, params)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_runs_low_precision_cache(dtype):
    md, q, geo = build(page=16, hq=4, hkv=1, d=32, ctx_lens=[], gen_hist=[130, 64], dtype=dtype)
    params = random_selection(md, 1, k=3, block_size=16)
    compare("torch", md, q, geo, params, rtol=2e-2, atol=2e-2)
    compare("torch", md, q, geo, None, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("block_size", [None, 8, 16])
def test_runs_mla(block_size):
    md, q, geo = build(page=16, hq=8, hkv=1, d=24, ctx_lens=[19], gen_hist=[70, 5], kind="mla", rank=16)
    params = None if block_size is None else random_selection(md, 1, k=4, block_size=block_size)
    compare("torch", md, q, geo, params)


def test_runs_chunked_equals_unchunked():
    md, q, geo = build(page=16, hq=4, hkv=2, d=16, ctx_lens=[40], gen_hist=[90, 33])
    params = random_selection(md, 2, k=3, block_size=16, pad_frac=0.0)
    for p in (None, params):
        a = TorchBackend().forward(q, md, 0, geo, p)
        b = TorchBackend(max_gather_bytes=1).forward(q, md, 0, geo, p)  # one token per chunk
        torch.testing.assert_close(a.out, b.out)
        torch.testing.assert_close(a.lse, b.lse)


def _shared_prefill_selection(md, hkv: int, qblock: int, k: int, block_size: int, seed: int = 0):
    """Block-sparse prefill: every query token of a ``qblock``-token query block (per request) names
    the same ``k`` blocks (its own block and random earlier ones), so tokens form shared groups."""
    g = torch.Generator().manual_seed(seed)
    pos = md.positions.to(torch.int64)
    out = torch.full((pos.numel(), hkv, k), -1, dtype=torch.int32)
    cache: dict[tuple[int, int], torch.Tensor] = {}
    for t, (r, p) in enumerate(zip(md.token_to_req.tolist(), pos.tolist())):
        key = (r, p // qblock)
        if key not in cache:
            own = p // block_size
            sel = torch.full((hkv, k), -1, dtype=torch.int32)
            for h in range(hkv):
                blocks = torch.cat([torch.tensor([own]), torch.randperm(own, generator=g)[: k - 1]]) if own else \
                    torch.tensor([0])
                sel[h, : blocks.numel()] = blocks.to(torch.int32)
            cache[key] = sel
        out[t] = cache[key]
    return SparseRuntimeParams.from_topk(out, block_size=block_size)


@pytest.mark.parametrize("max_gather_bytes", [256 << 20, 20_000])  # the small budget splits groups across chunks
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_shared_groups_block_sparse_prefill(block_size, max_gather_bytes):
    md, q, geo = build(page=16, hq=8, hkv=2, d=16, ctx_lens=[150, 64], gen_hist=[90, 7], seed=block_size)
    params = _shared_prefill_selection(md, 2, qblock=block_size, k=3, block_size=block_size, seed=block_size)
    ref = get_backend("vanilla").forward(q, md, 0, geo, params)
    out = TorchBackend(max_gather_bytes=max_gather_bytes).forward(q, md, 0, geo, params)
    torch.testing.assert_close(out.out, ref.out, rtol=1e-5, atol=1e-5)
    finite = torch.isfinite(ref.lse)
    assert torch.equal(torch.isposinf(out.lse), torch.isposinf(ref.lse))
    torch.testing.assert_close(out.lse[finite], ref.lse[finite], rtol=1e-5, atol=1e-5)


def test_shared_groups_mla_prefill():
    md, q, geo = build(page=16, hq=8, hkv=1, d=24, ctx_lens=[70, 33], gen_hist=[40], kind="mla", rank=16)
    compare("torch", md, q, geo, None)  # dense context rows: one group per request
    compare("torch", md, q, geo, _shared_prefill_selection(md, 1, qblock=16, k=2, block_size=16))


def test_shared_groups_long_prefill_and_an_empty_group():
    """A prompt longer than one chunk of rows (MAX_CHUNK_ROWS), dense and block-sparse, with one
    query block whose selection is all padding: the fused group path must give that block's
    tokens out 0 and lse +inf, as the golden does, and agree everywhere else."""
    from kvsieve.sparse.backends.torch_backend.backend import MAX_CHUNK_ROWS

    n = MAX_CHUNK_ROWS * 2 + 37
    md, q, geo = build(page=16, hq=4, hkv=1, d=16, ctx_lens=[n], gen_hist=[], seed=5)
    compare("torch", md, q, geo, None)
    params = _shared_prefill_selection(md, 1, qblock=32, k=3, block_size=32, seed=6)
    idx = params.sparse_attn_indices.clone()
    off = params.sparse_attn_offsets
    for t in range(64, 96):  # query block 2: nothing selected
        idx[:, off[t]: off[t + 1]] = -1
    params = SparseRuntimeParams(sparse_attn_indices=idx, sparse_attn_offsets=off,
                                 sparse_attn_indices_block_size=32)
    out, lse = compare("torch", md, q, geo, params)
    assert torch.count_nonzero(out[64:96]) == 0 and bool(torch.isposinf(lse[64:96]).all())


def test_chunk_ends_early_when_sharing_collapses():
    """The first 300 prefill rows all select the same 40 tokens (one gather serves a whole chunk,
    so the next chunk is sized for that sharing); the next 300 each select their own. The chunk
    that crosses over must stop where its gathers would pass ``max_gather_bytes``, not gather
    hundreds of rows at once, and the result must still equal the golden."""
    n, k, hkv, d = 600, 40, 1, 16
    md, q, geo = build(page=16, hq=2, hkv=hkv, d=d, ctx_lens=[n], gen_hist=[], seed=8)
    g = torch.Generator().manual_seed(9)
    sel = torch.full((n, hkv, k), -1, dtype=torch.int32)
    sel[:300] = torch.arange(k, dtype=torch.int32)  # shared (positions past a row's length are masked)
    for t in range(300, n):
        sel[t, 0] = torch.randperm(t + 1, generator=g)[:k].to(torch.int32)
    params = SparseRuntimeParams.from_topk(sel, block_size=1)
    per_row = k * hkv * (d + d) * 4  # one row's gathered K and V, fp32
    limit = 40 * per_row * 3 + n * k * hkv * 16  # ~40 rows' gathers (the backend's x3 for scores)
    backend = TorchBackend(max_gather_bytes=limit)
    res = backend.forward(q, md, 0, geo, params)
    ref = get_backend("vanilla").forward(q, md, 0, geo, params)
    torch.testing.assert_close(res.out, ref.out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res.lse, ref.lse, rtol=1e-5, atol=1e-5)
    buffers = backend._scratch._buffers  # the grow-only pool: its size is the largest gather
    gathered = sum(buf.numel() * 4 for key, buf in buffers.items() if key[0] in ("k", "v"))
    assert gathered * 3 <= limit, f"a chunk gathered {gathered} bytes of K/V; the bound allows {limit // 3}"


def test_rows_that_select_nothing_at_all():
    """Every row of a prefill (shared groups) and of a decode step (the one-token path) names no
    unit at all (width-0 segments): out 0 and lse +inf, as the golden gives, where PyTorch's flash
    kernel, handed no keys, kills the process with a floating-point exception."""
    for ctx, gen in (([40], []), ([], [70])):
        md, q, geo = build(page=16, hq=4, hkv=2, d=16, ctx_lens=ctx, gen_hist=gen, seed=1)
        rows = md.num_tokens
        params = SparseRuntimeParams(sparse_attn_indices=torch.zeros(2, 0, dtype=torch.int32),
                                     sparse_attn_offsets=torch.zeros(rows + 1, dtype=torch.int32),
                                     sparse_attn_indices_block_size=16)
        out, lse = compare("torch", md, q, geo, params)
        assert torch.count_nonzero(out) == 0 and bool(torch.isposinf(lse).all())
