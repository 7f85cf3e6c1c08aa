"""Plain-PyTorch reference of :func:`sparse_mla_decode` (same signature, same tile walk)."""
from __future__ import annotations

import torch

from ..common.naive import gather_attention_reference
from .plan import latent_views, plan_mla_decode


def sparse_mla_decode(
    q: torch.Tensor, latent_cache: torch.Tensor, block_table: torch.Tensor,
    token_to_req: torch.Tensor, kv_lens: torch.Tensor, indices: torch.Tensor | None,
    offsets: torch.Tensor | None, kv_lora_rank: int, sm_scale: float | None = None,
    threshold_scale_factor: float = 0.0, stats: torch.Tensor | None = None,
    num_splits: int | None = None, *, block_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``sparse_mla_decode.kernel.sparse_mla_decode``: same arguments and result."""
    plan = plan_mla_decode(q, latent_cache, block_table, token_to_req, kv_lens, indices,
                           offsets, kv_lora_rank, sm_scale, threshold_scale_factor, stats,
                           num_splits, block_size)
    k4, v4 = latent_views(latent_cache, kv_lora_rank)
    return gather_attention_reference(q, k4, v4, block_table, token_to_req, kv_lens, indices,
                                      offsets, block_size, plan, stats)
