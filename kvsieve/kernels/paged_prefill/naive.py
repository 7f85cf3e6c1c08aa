"""Plain-PyTorch reference of :func:`paged_prefill` (same signature, same tile walks)."""
from __future__ import annotations

import math

import torch

from ..common.gather.naive import gather_attention_reference, gather_rows, walk_tiles
from ..common.gather.plan import plan_gqa_gather
from .plan import plan_dense_prefill, query_tiles, select_prefill_path


def paged_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    token_to_req: torch.Tensor, kv_lens: torch.Tensor, indices: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None, block_size: int = 1, sm_scale: float | None = None,
    threshold_scale_factor: float = 0.0, stats: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``paged_prefill.triton.paged_prefill``: same arguments, paths and result."""
    base = plan_gqa_gather(q, k_cache, v_cache, block_table, token_to_req, kv_lens, indices,
                           offsets, block_size, sm_scale, threshold_scale_factor, stats,
                           num_splits if indices is not None else 1)
    if select_prefill_path(indices) == "sparse_gather":
        return gather_attention_reference(q, k_cache, v_cache, block_table, token_to_req,
                                          kv_lens, indices, offsets, block_size, base, stats)
    if num_splits not in (None, 1):
        raise ValueError(f"num_splits: the dense_tiled prefill path takes None or 1, "
                         f"got {num_splits!r}")
    p = plan_dense_prefill(q, k_cache.shape[1], v_cache.shape[3], sm_scale,
                           threshold_scale_factor)
    num_tokens, num_q_heads, _ = q.shape
    out = torch.zeros(num_tokens, num_q_heads, p.dv)
    lse = torch.full((num_tokens, num_q_heads), math.inf)
    skipped = walked = 0
    starts, counts = (x.tolist() for x in query_tiles(token_to_req.cpu(), p.tokens_per_tile))
    lens = kv_lens.long().cpu()
    reqs = token_to_req.long().cpu()
    for t0, cnt in zip(starts, counts):
        toks = torch.arange(t0, t0 + cnt)
        max_len = int(lens[toks].max())
        pos = torch.arange(max_len)
        ok = torch.ones(max_len, dtype=torch.bool)
        bt_row = block_table[int(reqs[t0])]
        row_len = lens[toks].repeat_interleave(p.group)
        lam = p.threshold_scale_factor / row_len.clamp(min=1).float() if p.threshold_scale_factor > 0 else None
        for h in range(k_cache.shape[1]):
            heads = torch.arange(h * p.group, (h + 1) * p.group)
            k = gather_rows(k_cache, bt_row, h, pos, ok)
            v = gather_rows(v_cache, bt_row, h, pos, ok)
            qf = q[toks][:, heads].float().cpu().reshape(cnt * p.group, -1)
            s = (qf @ k.T) * p.sm_scale
            s = torch.where(pos[None, :] < row_len[:, None], s, torch.full_like(s, -math.inf))
            o, ls, sk, wk = walk_tiles(s, v, p.block_n, 1, lam)
            out[toks[:, None], heads[None, :]] = o.reshape(cnt, p.group, -1)
            lse[toks[:, None], heads[None, :]] = ls.reshape(cnt, p.group)
            skipped, walked = skipped + sk, walked + wk
    if stats is not None:
        stats += torch.tensor([skipped, walked], dtype=stats.dtype, device=stats.device)
    return out.to(q.dtype).to(q.device), lse.to(q.device)
