"""Argument checks shared by the compaction kernel and its reference."""
from __future__ import annotations

import torch

from ..common.checks import check_shape, check_tensor

__all__ = ["check_keep"]


def check_keep(block_table_row: torch.Tensor, kept_indices: torch.Tensor, heads: int,
               device: torch.device) -> None:
    """``block_table_row [max_blocks]`` int32 and ``kept_indices [heads, n_keep]`` int32 on ``device``,
    unit stride along their last dim."""
    check_tensor("block_table_row", block_table_row, 1, (torch.int32,), device)
    check_tensor("kept_indices", kept_indices, 2, (torch.int32,), device)
    check_shape("kept_indices", kept_indices, (heads, None))
    if block_table_row.stride(0) != 1 or (kept_indices.shape[1] and kept_indices.stride(1) != 1):
        raise ValueError("block_table_row/kept_indices: expected unit stride along the last dim")
