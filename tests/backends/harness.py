"""A mixed batch through one layer, run by any backend and by the Vanilla golden on the same cache."""
from __future__ import annotations

import numpy as np
import torch

from kvsieve import AttentionMetadata, KVCacheManager, KVCacheSpec, SparseRuntimeParams
from kvsieve.metadata import TRANSLATIONS
from kvsieve.sparse.backends import AttentionGeometry, get_backend


def build(*, page: int, hq: int, hkv: int, d: int, ctx_lens: list[int], gen_hist: list[int], kind: str = "gqa",
          rank: int = 0, layout: str = "HND", dtype=torch.float32, seed: int = 0):
    """Cache with context requests (prefilled this step) and generation requests (1 new token)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(ctx_lens) + sum(gen_hist) + len(gen_hist)
    blocks = sum(-(-(n + 1) // page) for n in [*ctx_lens, *gen_hist]) + 2
    spec = KVCacheSpec(num_layers=1, num_blocks=blocks, tokens_per_block=page, kind=kind, num_kv_heads=hkv,
                       head_dim=d, kv_lora_rank=rank, rope_dim=d - rank if kind == "mla" else 0, layout=layout,
                       dtype=dtype, max_requests=len(ctx_lens) + len(gen_hist),
                       max_blocks_per_seq=max(-(-(n + 1) // page) for n in [*ctx_lens, *gen_hist, 1]))
    mgr = KVCacheManager(spec)
    rids = list(range(len(ctx_lens) + len(gen_hist)))
    for rid, n in zip(rids[len(ctx_lens):], gen_hist):  # history of generation requests
        mgr.add_request(rid, n)
        _fill(mgr, rid, 0, n, kind, hkv, d, dtype, g)
    for rid, n in zip(rids, ctx_lens):
        mgr.add_request(rid, n)
        _fill(mgr, rid, 0, n, kind, hkv, d, dtype, g)
    for rid in rids[len(ctx_lens):]:
        mgr.append_tokens(rid, 1)
        _fill(mgr, rid, mgr.valid_len(rid) - 1, 1, kind, hkv, d, dtype, g)
    md = AttentionMetadata(kv_cache_manager=mgr, max_num_requests=len(rids), max_num_tokens=max(total, 1),
                           translations=TRANSLATIONS)
    md.request_ids = rids
    md.seq_lens = [*ctx_lens, *([1] * len(gen_hist))]
    md.num_contexts = len(ctx_lens)
    md.prepare()
    q = torch.randn(md.num_tokens, hq, d, generator=g).to(dtype)
    geo = AttentionGeometry(kind=kind, num_q_heads=hq, num_kv_heads=1 if kind == "mla" else hkv, head_dim=d,
                            sm_scale=d ** -0.5, kv_lora_rank=rank)
    return md, q, geo


def _fill(mgr, rid, start, n, kind, hkv, d, dtype, g):
    s = np.full(n, mgr.slot(rid), dtype=np.int32)
    pos = np.arange(start, start + n)
    if kind == "mla":
        mgr.write(0, s, pos, torch.randn(n, d, generator=g).to(dtype))
    else:
        mgr.write(0, s, pos, torch.randn(n, hkv, d, generator=g).to(dtype), torch.randn(n, hkv, d, generator=g).to(dtype))


def random_selection(md, hkv: int, k: int, block_size: int, seed: int = 0, pad_frac: float = 0.2,
                     overshoot: int = 0) -> SparseRuntimeParams:
    """Per-token random selection of ``k`` distinct units (tokens or blocks) within the causal range
    (+ ``overshoot`` units beyond it, which must be skipped), a fraction padded with -1."""
    g = torch.Generator().manual_seed(seed)
    lens = md.token_kv_lens.to(torch.int64)
    out = torch.full((lens.numel(), hkv, k), -1, dtype=torch.int32)
    for t, n in enumerate(lens.tolist()):
        units = -(-n // block_size) + overshoot
        for h in range(hkv):
            perm = torch.randperm(units, generator=g)[:k]
            keep = torch.rand(perm.numel(), generator=g) >= pad_frac
            sel = perm[keep]
            out[t, h, : sel.numel()] = sel.to(torch.int32)
    return SparseRuntimeParams.from_topk(out, block_size=block_size)


def compare(backend: str, md, q, geo, params, rtol=1e-5, atol=1e-5):
    res = get_backend(backend).forward(q, md, 0, geo, params)
    out, lse = res.out, res.lse
    res = get_backend("vanilla").forward(q, md, 0, geo, params)
    ref, ref_lse = res.out, res.lse
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isposinf(lse), torch.isposinf(ref_lse)), "empty rows must give lse +inf"
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=rtol, atol=atol)
    return out, lse
