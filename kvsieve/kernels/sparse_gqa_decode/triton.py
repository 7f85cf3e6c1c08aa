"""Sparse (or dense) paged GQA decode attention in Triton, with split-K and skip-softmax."""
from __future__ import annotations

import torch

from ..common.gather.plan import plan_gqa_gather
from ..common.gather.triton import launch_gather_attention


def sparse_gqa_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    token_to_req: torch.Tensor, kv_lens: torch.Tensor, indices: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None, block_size: int = 1, sm_scale: float | None = None,
    threshold_scale_factor: float = 0.0, stats: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query token over its selected KV positions of a paged GQA cache.

    Args:
        q: ``[num_tokens, num_q_heads, head_dim]`` fp16/bf16/fp32, any strides.
        k_cache: ``[num_blocks, num_kv_heads, page_size, head_dim]``, q's dtype, any strides
            (HND pool ``pool[:, 0]`` or NHD pool ``pool[:, 0].transpose(1, 2)``).
        v_cache: ``[num_blocks, num_kv_heads, page_size, head_dim_v]``, q's dtype, any strides.
        block_table: ``[batch, max_blocks_per_seq]`` int32, unit stride along dim 1; request
            row ``b``'s logical page ``i`` is physical block ``block_table[b, i]`` (0 = sentinel).
        token_to_req: ``[num_tokens]`` int32, block-table row of each query token.
        kv_lens: ``[num_tokens]`` int32, positions ``[0, kv_lens[t])`` are visible; positions
            at or beyond it are never read.
        indices: ``[num_kv_heads, total_selected]`` int32 or None (dense). For token ``t`` and
            KV head ``h`` the selection is ``indices[h, offsets[t]:offsets[t+1]]``: request-local
            positions (``block_size == 1``) or block ids covering ``[i*S, (i+1)*S)``
            (``block_size == S``); -1 entries and entries beyond ``kv_lens[t]`` are skipped.
        offsets: ``[num_tokens + 1]`` int32 or None (with ``indices``).
        block_size: selection granularity ``S`` (independent of ``page_size``).
        sm_scale: softmax scale, default ``1/sqrt(head_dim)``.
        threshold_scale_factor: skip-softmax (BLASST) factor; 0 disables (dense path). A KV
            tile of ``block_n`` walked positions is skipped when, for every query head of the
            program, ``exp(tile_max - running_max) < factor / kv_lens[t]``.
        stats: optional ``[2]`` int32/int64 tensor; (skipped tiles, walked tiles) are added.
        num_splits: split-K factor over the walked KV tiles; None = launch heuristic.

    Returns:
        ``out [num_tokens, num_q_heads, head_dim_v]`` in q's dtype and ``lse [num_tokens,
        num_q_heads]`` fp32 (natural log of sum(exp(sm_scale * q.k))); a row with no valid
        entry gets out 0 and lse ``+inf``. Query head ``hq`` reads KV head ``hq // group``.
    """
    p = plan_gqa_gather(q, k_cache, v_cache, block_table, token_to_req, kv_lens, indices,
                        offsets, block_size, sm_scale, threshold_scale_factor, stats, num_splits)
    return launch_gather_attention(
        q, k_cache, v_cache, block_table, token_to_req, kv_lens, indices, offsets, block_size,
        p.sm_scale, p.threshold_scale_factor, stats, p.num_splits, group=p.group, block_h=p.block_h,
        da=p.da, dv=p.dv, v_is_k=False, block_n=p.block_n, num_warps=p.num_warps,
        num_stages=p.num_stages, interpret=p.arch == "interpreter")
