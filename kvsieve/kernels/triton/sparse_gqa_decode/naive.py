"""Plain-PyTorch reference of :func:`sparse_gqa_decode` (same signature, same tile walk as the
shared gather, :mod:`kvsieve.kernels.triton.common.naive`)."""
from __future__ import annotations

import torch

from ..common.naive import gather_attention_reference
from .plan import plan_gqa_decode

__all__ = ["sparse_gqa_decode"]


def sparse_gqa_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    token_to_req: torch.Tensor, kv_lens: torch.Tensor, indices: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None, block_size: int = 1, sm_scale: float | None = None,
    threshold_scale_factor: float = 0.0, stats: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``sparse_gqa_decode.kernel.sparse_gqa_decode``: same arguments and result."""
    plan = plan_gqa_decode(q, k_cache, v_cache, block_table, token_to_req, kv_lens, indices,
                           offsets, block_size, sm_scale, threshold_scale_factor, stats,
                           num_splits)
    return gather_attention_reference(q, k_cache, v_cache, block_table, token_to_req, kv_lens,
                                      indices, offsets, block_size, plan, stats)
