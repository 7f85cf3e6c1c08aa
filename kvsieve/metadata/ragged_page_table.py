"""Translation for FlashInfer-style readers: the ragged page table, as the torch backend reads it.

For a batch of ``B`` requests:

* ``paged_kv_indices [sum_pages]`` int32: the pages covering each request's *valid* tokens,
  concatenated in batch order;
* ``paged_kv_indptr [B + 1]`` int32: request ``b`` owns ``indices[indptr[b]:indptr[b+1]]``;
* ``batch_indices [num_tokens]`` int32: the request row of every new token of the step.

FlashInfer's ``paged_kv_last_page_len`` and ``qo_indptr`` are not built: the torch backend takes
each query token's length from ``AttentionMetadata.token_kv_lens`` and its phase rows from
``AttentionMetadata.phase_rows``, so nothing would read them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["RaggedPageTable"]


@dataclass
class RaggedPageTable:
    """Preallocated host/device buffers; :meth:`fill` writes the first rows in place."""

    max_batch: int
    max_tokens: int
    max_pages: int
    device: torch.device

    def __post_init__(self) -> None:
        def buf(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=self.device)

        self.paged_kv_indices_buf = buf(self.max_pages)
        self.paged_kv_indptr_buf = buf(self.max_batch + 1)
        self.batch_indices_buf = buf(self.max_tokens)
        self.batch = 0
        self.num_pages = 0
        self.num_tokens = 0

    def fill(self, block_table: np.ndarray, slots: np.ndarray, valid_lens: np.ndarray,
             seq_lens: np.ndarray, page_size: int) -> None:
        """Vectorized: one masked gather of the ledger rows, prefix sums, one copy per buffer."""
        b = len(slots)
        if b > self.max_batch:
            raise ValueError(f"batch {b} exceeds the ragged page table's max_batch={self.max_batch}")
        pages = (valid_lens + page_size - 1) // page_size
        indptr = np.zeros(b + 1, dtype=np.int32)
        np.cumsum(pages, out=indptr[1:])
        total = int(indptr[-1])
        if total > self.max_pages:
            raise ValueError(f"{total} pages exceed the ragged page table's max_pages={self.max_pages}")
        width = int(pages.max()) if b else 0
        rows = block_table[slots, :width]
        indices = rows[np.arange(width)[None, :] < pages[:, None]]
        n = int(np.sum(seq_lens))
        if n > self.max_tokens:
            raise ValueError(f"{n} query tokens exceed the ragged page table's max_tokens={self.max_tokens}")
        batch_idx = np.repeat(np.arange(b, dtype=np.int32), seq_lens)
        for dst, src in (
            (self.paged_kv_indices_buf, indices), (self.paged_kv_indptr_buf, indptr),
            (self.batch_indices_buf, batch_idx),
        ):
            dst[: len(src)].copy_(torch.from_numpy(np.ascontiguousarray(src, dtype=np.int32)), non_blocking=True)
        self.batch, self.num_pages, self.num_tokens = b, total, n

    @property
    def paged_kv_indices(self) -> torch.Tensor:
        return self.paged_kv_indices_buf[: self.num_pages]

    @property
    def paged_kv_indptr(self) -> torch.Tensor:
        return self.paged_kv_indptr_buf[: self.batch + 1]

    @property
    def batch_indices(self) -> torch.Tensor:
        return self.batch_indices_buf[: self.num_tokens]
