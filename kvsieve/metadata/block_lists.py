"""Translation for the Vanilla golden: one Python list of block ids per sequence (NHD readers)."""
from __future__ import annotations

import numpy as np

__all__ = ["build_block_lists"]


def build_block_lists(block_table: np.ndarray, num_blocks: np.ndarray, slots: np.ndarray) -> list[list[int]]:
    """``block_ids_per_seq``: the first ``num_blocks[s]`` entries of ``block_table[s]`` per slot.

    ``block_table [max_requests, max_blocks_per_seq]`` int32 (the ledger), ``num_blocks
    [max_requests]``, ``slots [batch]``. One slice per request, no per-block loop.
    """
    rows = block_table[slots]
    return [rows[i, : num_blocks[s]].tolist() for i, s in enumerate(slots.tolist())]
