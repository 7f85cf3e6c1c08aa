"""Translation for the Vanilla golden: the block ids of each sequence (NHD readers).

``prepare()`` does one vectorized gather of the batch's ledger rows; the Python ``list[int]`` of a
sequence is built only when a reader asks for it (``block_ids_per_seq[i]``), so a step pays for
the Python objects it actually reads, not for every block of the batch.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

__all__ = ["BlockLists", "build_block_lists"]


class BlockLists(Sequence):
    """``block_ids_per_seq``: sequence ``i``'s block ids as a ``list[int]`` (built on access).

    ``rows [batch, width]`` int32 (a private copy of the ledger rows), ``counts [batch]``.
    Compares equal to a ``list[list[int]]`` with the same contents.
    """

    def __init__(self, rows: np.ndarray, counts: np.ndarray) -> None:
        self._rows = rows
        self._counts = counts

    def __len__(self) -> int:
        return len(self._counts)

    def __getitem__(self, i):  # noqa: ANN001, ANN204  (int -> list[int], slice -> list[list[int]])
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"block_ids_per_seq index {i} out of range for {len(self)} sequences")
        return self._rows[i, : self._counts[i]].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or len(other) != len(self):
            return False
        return all(a == list(b) for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"BlockLists({list(self)!r})"


def build_block_lists(block_table: np.ndarray, num_blocks: np.ndarray, slots: np.ndarray) -> BlockLists:
    """Gather the ledger rows of ``slots``: ``block_table [max_requests, max_blocks_per_seq]``
    int32, ``num_blocks [max_requests]``, ``slots [batch]``; no per-request or per-block loop."""
    counts = num_blocks[slots]
    width = int(counts.max()) if len(slots) else 0
    return BlockLists(block_table[slots, :width], counts)
