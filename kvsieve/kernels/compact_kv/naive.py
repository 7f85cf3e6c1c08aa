"""Plain-PyTorch references of the compaction kernels (same signatures)."""
from __future__ import annotations

import torch

from ..common.checks import FLOAT_DTYPES, check_tensor
from .plan import check_keep


def _compact(cache: torch.Tensor, block_table_row: torch.Tensor, kept: torch.Tensor) -> None:
    page_size = cache.shape[2]
    bt = block_table_row.long()
    for h in range(kept.shape[0]):
        src = kept[h].long()
        src = src[src >= 0]
        dst = torch.arange(src.numel(), device=cache.device)
        rows = cache[bt[src // page_size], h, src % page_size].clone()
        cache[bt[dst // page_size], h, dst % page_size] = rows


def compact_kv_(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table_row: torch.Tensor,
                kept_indices: torch.Tensor) -> None:
    """Reference of ``compact_kv.triton.compact_kv_`` (gather, then scatter)."""
    check_tensor("k_cache", k_cache, 4, FLOAT_DTYPES)
    check_tensor("v_cache", v_cache, 4, (k_cache.dtype,), k_cache.device)
    check_keep(block_table_row, kept_indices, k_cache.shape[1], k_cache.device)
    _compact(k_cache, block_table_row, kept_indices)
    _compact(v_cache, block_table_row, kept_indices)


def compact_mla_kv_(latent_cache: torch.Tensor, block_table_row: torch.Tensor,
                    kept_indices: torch.Tensor) -> None:
    """Reference of ``compact_kv.triton.compact_mla_kv_``."""
    check_tensor("latent_cache", latent_cache, 3, FLOAT_DTYPES)
    check_keep(block_table_row, kept_indices, 1, latent_cache.device)
    _compact(latent_cache.unsqueeze(1), block_table_row, kept_indices)
