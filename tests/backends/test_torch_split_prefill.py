"""The torch backend's split prefill (:mod:`kvsieve.sparse.backends.torch_backend.prefill`) against Vanilla.

Tokens of a group (a query block of a block-sparse prefill, a prefill's dense rows) attend the
runs every member reads whole with no mask and the rest under a mask, merged by log-sum-exp.
Each case checks out, lse and ``attended`` against the golden and that the split path (or, where
it must not apply, the masked path) really ran.
"""
from __future__ import annotations

import pytest
import torch

from kvsieve import AttentionMetadata, KVCacheManager, KVCacheSpec, SparseRuntimeParams
from kvsieve.metadata import TRANSLATIONS
from kvsieve.sparse.backends import AttentionGeometry, TorchBackend, get_backend
from kvsieve.sparse.backends.torch_backend import backend as torch_backend
from kvsieve.sparse.backends.torch_backend import prefill as torch_prefill

from .harness import build, random_selection


@pytest.fixture
def calls(monkeypatch):
    """Counts split-path chunks and, within them, flash calls with and without a mask."""
    seen = {"split": 0, "unmasked": 0, "masked": 0}
    split, flash = torch_backend.split_prefill, torch_prefill.flash_cpu

    def split_spy(*args, **kwargs):
        seen["split"] += 1
        return split(*args, **kwargs)

    def flash_spy(q, k, v, bias, scale):
        seen["unmasked" if bias is None else "masked"] += 1
        return flash(q, k, v, bias, scale)

    monkeypatch.setattr(torch_backend, "split_prefill", split_spy)
    monkeypatch.setattr(torch_prefill, "flash_cpu", flash_spy)
    return seen


def _check(md, q, geo, params, backend=None, tol=1e-5):
    res = (backend or TorchBackend()).forward(q, md, 0, geo, params)
    ref = get_backend("vanilla").forward(q, md, 0, geo, params)
    torch.testing.assert_close(res.out.float(), ref.out.float(), rtol=tol, atol=tol)
    assert torch.equal(torch.isposinf(res.lse), torch.isposinf(ref.lse)), "empty rows must give lse +inf"
    finite = torch.isfinite(ref.lse)
    torch.testing.assert_close(res.lse[finite], ref.lse[finite], rtol=tol, atol=tol)
    assert torch.equal(res.attended, ref.attended)
    return res


def _block_prefill(md, hkv: int, qblock: int, block_size: int, choose) -> SparseRuntimeParams:
    """Every token of a ``qblock``-token query block (per request) names the blocks
    ``choose(head, own_block)`` gives (a list; any order, repeats allowed), called once per block."""
    named: dict[tuple[int, int], list[list[int]]] = {}
    rows = []
    for r, p in zip(md.token_to_req.tolist(), md.positions.tolist()):
        own = (p // qblock) * qblock // block_size
        if (r, own) not in named:
            named[(r, own)] = [list(choose(h, own)) for h in range(hkv)]
        rows.append(named[(r, own)])
    k = max(1, max(len(r) for row in rows for r in row))
    idx = torch.full((len(rows), hkv, k), -1, dtype=torch.int32)
    for t, row in enumerate(rows):
        for h, r in enumerate(row):
            idx[t, h, : len(r)] = torch.tensor(r, dtype=torch.int32)
    flat = idx.permute(1, 0, 2).reshape(hkv, -1)
    return SparseRuntimeParams(sparse_attn_indices=flat, sparse_attn_offsets=torch.arange(len(rows) + 1,
                               dtype=torch.int32) * k, sparse_attn_indices_block_size=block_size)


def _chunked(page: int, hq: int, hkv: int, d: int, prefix: int, new: int, seed: int = 0):
    """One request with ``prefix`` tokens cached and ``new`` prefilled this step (a chunked prefill)."""
    g = torch.Generator().manual_seed(seed)
    total = prefix + new
    nb = -(-total // page)
    spec = KVCacheSpec(num_layers=1, num_blocks=nb + 3, tokens_per_block=page, num_kv_heads=hkv, head_dim=d,
                       max_requests=1, max_blocks_per_seq=nb)
    mgr = KVCacheManager(spec)
    mgr.add_request(0, prefix)
    mgr.append_tokens(0, new)
    mgr.block_table[0, :nb] = (torch.randperm(nb, generator=g) + 2).numpy()  # pages out of order
    mgr.pools[0].normal_(generator=g)
    md = AttentionMetadata(kv_cache_manager=mgr, max_num_requests=1, max_num_tokens=new, translations=TRANSLATIONS)
    md.request_ids, md.seq_lens, md.num_contexts = [0], [new], 1
    md.prepare()
    geo = AttentionGeometry(kind="gqa", num_q_heads=hq, num_kv_heads=hkv, head_dim=d, sm_scale=d ** -0.5)
    return md, torch.randn(new, hq, d, generator=g), geo


def _earlier(k: int, seed: int):
    """``choose``: the own block and ``k`` random earlier ones."""
    g = torch.Generator().manual_seed(seed)
    return lambda h, own: [own, *torch.randperm(own, generator=g)[:k].tolist()] if own else [0]


@pytest.mark.parametrize("block_size,page", [(32, 16), (16, 16), (8, 16)])  # runs of 16, 16, 8 positions
def test_full_width_differs_between_kv_heads(calls, block_size, page):
    """Head 0 reads up to 3 earlier blocks, head 1 at most 1: their entries batch apart."""
    md, q, geo = build(page=page, hq=8, hkv=2, d=16, ctx_lens=[200, 130], gen_hist=[], seed=block_size)
    pick = _earlier(3, block_size)
    params = _block_prefill(md, 2, block_size, block_size, lambda h, own: pick(h, own)[: 4 if h == 0 else 2])
    _check(md, q, geo, params)
    assert calls["split"] and calls["unmasked"] and calls["masked"]


def test_groups_with_no_full_columns(calls):
    """Only the diagonal block (all partial), and blocks past the causal range that nobody reads."""
    md, q, geo = build(page=16, hq=4, hkv=2, d=16, ctx_lens=[100], gen_hist=[], seed=3)
    _check(md, q, geo, _block_prefill(md, 2, 32, 32, lambda h, own: [own]))
    assert calls["split"] and calls["unmasked"] == 0
    _check(md, q, geo, _block_prefill(md, 2, 32, 32, lambda h, own: [own + 1, own, own + 2][: h + 2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_prefill(calls, dtype):
    """Dense rows of two prompts, the first longer than a chunk of rows, and a tiny gather budget
    (one group per chunk, groups cut mid-way)."""
    n = torch_backend.MAX_CHUNK_ROWS + 100
    md, q, geo = build(page=16, hq=4, hkv=2, d=16, ctx_lens=[n, 37], gen_hist=[20], seed=4, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    _check(md, q, geo, None, tol=tol)
    assert calls["split"] and calls["unmasked"]
    _check(md, q, geo, None, backend=TorchBackend(max_gather_bytes=200_000), tol=tol)


@pytest.mark.parametrize("params", ["dense", "sparse"])
def test_chunked_prefill(calls, params):
    """A cached prefix of 150 tokens and 230 new ones: query blocks do not start at the first new
    token, so the first group is short and every group's lengths start mid-block."""
    md, q, geo = _chunked(page=16, hq=6, hkv=2, d=16, prefix=150, new=230, seed=5)
    sel = None if params == "dense" else _block_prefill(md, 2, 32, 32, _earlier(2, 6))
    _check(md, q, geo, sel)
    _check(md, q, geo, sel, backend=TorchBackend(max_gather_bytes=100_000))
    assert calls["split"] and calls["unmasked"]


def test_repeats_and_any_order(calls):
    """Blocks listed out of order and twice (possible with validation off): read once each."""
    md, q, geo = build(page=16, hq=4, hkv=2, d=16, ctx_lens=[160], gen_hist=[], seed=7)
    params = _block_prefill(md, 2, 32, 32, lambda h, own: [own, 0, own, 0][h:] if own else [0, 0])
    _check(md, q, geo, params)
    assert calls["split"]


def test_rows_that_read_nothing(calls):
    """A query block whose blocks all lie past its tokens (nothing read: out 0, lse +inf) beside
    ordinary ones; then one that names an earlier block and the second half of its own 32 tokens,
    which its first 16 tokens do not reach (they read the full run only, none of the partial)."""
    md, q, geo = build(page=16, hq=4, hkv=1, d=16, ctx_lens=[128], gen_hist=[], seed=8)
    params = _block_prefill(md, 1, 32, 32, lambda h, own: [own + 1] if own == 1 else [own])
    res = _check(md, q, geo, params)
    assert calls["split"] and torch.count_nonzero(res.out[32:64]) == 0 and bool(res.lse[32:64].isposinf().all())
    _check(md, q, geo, _block_prefill(md, 1, 32, 16, lambda h, own: [1, own + 1] if own == 2 else [own, own + 1]))


@pytest.mark.parametrize("case", ["nhd", "mla", "ungrouped"])
def test_falls_back_off_the_split_path(calls, case):
    """An NHD cache (per-token gather), an MLA cache (masked path) and a token-sparse prefill
    (no two tokens share a gather) never take the split path, and still match the golden."""
    if case == "mla":
        md, q, geo = build(page=16, hq=8, hkv=1, d=24, ctx_lens=[70], gen_hist=[], kind="mla", rank=16)
        params = _block_prefill(md, 1, 16, 16, _earlier(2, 9))
    else:
        md, q, geo = build(page=16, hq=4, hkv=2, d=16, ctx_lens=[90], gen_hist=[], seed=9,
                           layout="NHD" if case == "nhd" else "HND")
        params = (_block_prefill(md, 2, 16, 16, _earlier(2, 9)) if case == "nhd" else
                  random_selection(md, 2, k=6, block_size=1, pad_frac=0.0, seed=10))
    _check(md, q, geo, params)
    assert calls["split"] == 0
