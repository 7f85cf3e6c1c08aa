"""Translation for TRT-LLM-style readers: the 4-D block-offset table.

``kv_cache_block_offsets [num_pools, max_batch, 2, max_blocks_per_seq]`` int32. A pool stores a
block as ``[2, ...]`` (K then V), so viewed as ``num_blocks * 2`` half-blocks the K offset of block
``b`` is ``2*b`` and the V offset ``2*b + 1``. Rows: each context request once (beam width 1),
each generation request ``beam_width`` times. On the non-speculative path the copied width is
capped at the batch's longest row; on the speculative path the whole addressable row is copied
(drafts may land in reserved pages). The asynchronous host->device copy reads from a private
per-call snapshot so that the next ``fill`` cannot race it; the persistent host buffer stays for
synchronous readers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["BlockOffsetTable"]


@dataclass
class BlockOffsetTable:
    num_pools: int
    max_batch: int
    max_blocks_per_seq: int
    device: torch.device

    def __post_init__(self) -> None:
        shape = (self.num_pools, self.max_batch, 2, self.max_blocks_per_seq)
        self.host = np.zeros(shape, dtype=np.int32)  # persistent, for synchronous readers
        self.device_buf = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.num_rows = 0
        self.width = 0
        self.last_snapshot: np.ndarray | None = None

    def fill(self, tables: list[np.ndarray], slots: np.ndarray, num_blocks: list[np.ndarray],
             num_contexts: int, beam_width: int, speculative: bool) -> None:
        """Write rows for the batch and start the device copy.

        ``tables[p]`` is pool group ``p``'s ledger ``[max_requests, max_blocks_per_seq]``;
        ``num_blocks[p]`` its allocated-block counts per slot; ``slots [batch]`` context requests
        first. Generation rows are repeated ``beam_width`` times.
        """
        if len(tables) != self.num_pools:
            raise ValueError(f"expected {self.num_pools} pool tables, got {len(tables)}")
        if beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {beam_width}")
        reps = np.ones(len(slots), dtype=np.int64)
        reps[num_contexts:] = beam_width
        row_slots = np.repeat(slots, reps)
        rows = len(row_slots)
        if rows > self.max_batch:
            raise ValueError(f"{rows} rows (with beams) exceed the block-offset table's max_batch={self.max_batch}")
        if speculative:
            width = self.max_blocks_per_seq
        else:
            width = max((int(nb[slots].max()) for nb in num_blocks), default=0) if len(slots) else 0
        for p, table in enumerate(tables):
            blocks = table[row_slots, :width].astype(np.int32)
            self.host[p, :rows, 0, :width] = blocks * 2
            self.host[p, :rows, 1, :width] = blocks * 2 + 1
        snapshot = np.ascontiguousarray(self.host[:, :rows, :, :width])
        src = torch.from_numpy(snapshot)
        if self.device_buf.is_cuda:
            src = src.pin_memory()
        self.device_buf[:, :rows, :, :width].copy_(src, non_blocking=True)
        self.last_snapshot = snapshot  # keeps the copy's source alive until the next fill
        self.num_rows, self.width = rows, width

    @property
    def kv_cache_block_offsets(self) -> torch.Tensor:
        """The device table (full capacity; rows ``[:num_rows]`` and columns ``[:width]`` are current)."""
        return self.device_buf
