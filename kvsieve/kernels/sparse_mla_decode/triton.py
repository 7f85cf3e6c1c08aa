"""Sparse absorbed-MLA decode over a paged latent cache, in Triton (split-K + merge)."""
from __future__ import annotations

import torch

from ..common.gather.triton import launch_gather_attention
from .plan import latent_views, plan_mla_decode


def sparse_mla_decode(
    q: torch.Tensor, latent_cache: torch.Tensor, block_table: torch.Tensor,
    token_to_req: torch.Tensor, kv_lens: torch.Tensor, indices: torch.Tensor | None,
    offsets: torch.Tensor | None, kv_lora_rank: int, sm_scale: float | None = None,
    threshold_scale_factor: float = 0.0, stats: torch.Tensor | None = None,
    num_splits: int | None = None, *, block_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention of each query token over its selected latent-cache tokens.

    Args:
        q: ``[num_tokens, num_heads, kv_lora_rank + rope_dim]`` fp16/bf16/fp32 (absorbed
            nope part first, rope part last; e.g. 512 + 64), any strides.
        latent_cache: ``[num_blocks, page_size, kv_lora_rank + rope_dim]``, q's dtype, any
            strides. K is the full row, V its first ``kv_lora_rank`` columns.
        block_table: ``[batch, max_blocks_per_seq]`` int32 (0 = sentinel block).
        token_to_req: ``[num_tokens]`` int32 block-table row per token.
        kv_lens: ``[num_tokens]`` int32 visible length per token.
        indices: ``[1, total_selected]`` int32 request-local token positions
            (``block_size == 1``) or block ids covering ``[i*S, (i+1)*S)`` (``block_size == S``),
            -1 = padding, positions ``>= kv_lens[t]`` skipped; None = dense over ``kv_lens``.
        offsets: ``[num_tokens + 1]`` int32 (token ``t`` selects
            ``indices[0, offsets[t]:offsets[t+1]]``), or None with ``indices``.
        kv_lora_rank: V width / nope width, a power of two (512 for DeepSeek).
        sm_scale: softmax scale, default ``1/sqrt(kv_lora_rank + rope_dim)``.
        threshold_scale_factor, stats, num_splits: as in ``sparse_gqa_decode``; the skip rule
            is evaluated over the heads of one program's head group.
        block_size: selection granularity ``S`` (independent of ``page_size``).

    Returns:
        ``out [num_tokens, num_heads, kv_lora_rank]`` in q's dtype and ``lse [num_tokens,
        num_heads]`` fp32 natural log; no valid entry -> out 0, lse ``+inf``.
    """
    p = plan_mla_decode(q, latent_cache, block_table, token_to_req, kv_lens, indices, offsets,
                        kv_lora_rank, sm_scale, threshold_scale_factor, stats, num_splits, block_size)
    k4, v4 = latent_views(latent_cache, kv_lora_rank)
    return launch_gather_attention(
        q, k4, v4, block_table, token_to_req, kv_lens, indices, offsets, block_size, p.sm_scale,
        p.threshold_scale_factor, stats, p.num_splits, group=p.group, block_h=p.block_h, da=p.da, dv=p.dv,
        v_is_k=True, block_n=p.block_n, num_warps=p.num_warps, num_stages=p.num_stages,
        interpret=p.arch == "interpreter")
