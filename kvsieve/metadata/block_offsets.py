"""Translation for TRT-LLM-style readers: the 4-D block-offset table.

``kv_cache_block_offsets [num_pools, max_batch, 2, max_blocks_per_seq]`` int32 with
``num_pools == 1`` (kvsieve has one pool group; the leading axis keeps TensorRT-LLM's layout). A
GQA pool stores a block as ``[2, ...]`` (K then V), so viewed as ``num_blocks * 2`` half-blocks the
K offset of block ``b`` is ``2*b`` and the V offset ``2*b + 1``; the Triton and CuTe GQA paths
address the pool this way (:func:`half_block_views`).

Rows, as the seed lays them out: context requests first, one row each; then each generation
request's beams, ``beam_width`` consecutive rows (beam ``b`` of generation request ``j`` at row
``num_contexts + j * beam_width + b``), so the table holds ``num_contexts + num_generations *
beam_width`` rows and a batch whose generation rows are not whole beam groups is refused
(:func:`beam_rows`). A beam is a forked request (:meth:`KVCacheManager.fork`, ``reorder``) with
its own ledger row, sharing blocks by reference.

On the non-speculative path the copied width is capped at the batch's longest row; on the
speculative path the whole addressable row is copied (drafts may land in reserved pages). The
asynchronous host->device copy reads from a private per-call snapshot so that the next ``fill``
cannot race it; the persistent host buffer stays for synchronous readers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["BlockOffsetTable", "beam_rows", "half_block_views"]


@dataclass
class BlockOffsetTable:
    """Preallocated host/device offset tables; :meth:`fill` writes the batch's rows in place."""

    max_batch: int
    max_blocks_per_seq: int
    device: torch.device

    def __post_init__(self) -> None:
        shape = (1, self.max_batch, 2, self.max_blocks_per_seq)
        self.host = np.zeros(shape, dtype=np.int32)  # persistent, for synchronous readers
        self.device_buf = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.num_rows = 0
        self.width = 0
        self.last_snapshot: np.ndarray | None = None

    def fill(self, table: np.ndarray, slots: np.ndarray, num_blocks: np.ndarray, speculative: bool, *,
             num_contexts: int = 0, beam_width: int = 1) -> None:
        """Write rows for the batch and start the device copy.

        ``table`` is the pool's ledger ``[max_requests, max_blocks_per_seq]``; ``num_blocks`` its
        allocated-block counts per slot; ``slots [num_contexts + num_generations * beam_width]``:
        the context requests' slots, then every generation request's ``beam_width`` beam slots
        (:func:`beam_rows` checks the count and lays them out). Raises ``ValueError`` for more rows
        than ``max_batch`` or generation rows that are not whole beam groups, writing nothing.
        """
        ctx, beams = beam_rows(slots, num_contexts, beam_width)
        slots = np.concatenate([ctx, beams.reshape(-1)])  # row num_contexts + j * beam_width + b: beam b of request j
        rows = len(slots)
        if rows > self.max_batch:
            raise ValueError(f"{rows} rows exceed the block-offset table's max_batch={self.max_batch}")
        if speculative:
            width = self.max_blocks_per_seq
        else:
            width = int(num_blocks[slots].max()) if rows else 0
        blocks = table[slots, :width].astype(np.int32)
        self.host[0, :rows, 0, :width] = blocks * 2
        self.host[0, :rows, 1, :width] = blocks * 2 + 1
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

    @property
    def k_offsets(self) -> torch.Tensor:
        """Device int32 ``[num_rows, max(width, 1)]``: half-block offset ``2*b`` of each page's K."""
        return self.device_buf[0, : self.num_rows, 0, : max(self.width, 1)]


def beam_rows(slots: np.ndarray, num_contexts: int, beam_width: int) -> tuple[np.ndarray, np.ndarray]:
    """Split a step's rows ``slots [num_contexts + num_generations * beam_width]`` into the context
    rows (once each) ``[num_contexts]`` and the generation rows by beam ``[num_generations,
    beam_width]``. Raises ``ValueError`` naming the counts when ``beam_width < 1``, ``num_contexts``
    is outside ``[0, rows]`` or the generation rows are not a multiple of ``beam_width``."""
    rows = len(slots)
    if isinstance(beam_width, bool) or not isinstance(beam_width, (int, np.integer)) or beam_width < 1:
        raise ValueError(f"beam_width must be an int >= 1, got {beam_width!r}")
    if not 0 <= num_contexts <= rows:
        raise ValueError(f"num_contexts={num_contexts} is outside [0, {rows}] (the step's rows)")
    gen = rows - num_contexts
    if gen % beam_width:
        raise ValueError(f"{rows} rows with {num_contexts} context requests leave {gen} generation rows, not a "
                         f"multiple of beam_width={beam_width}: each generation request has beam_width rows "
                         f"(num_contexts + num_generations * beam_width rows in all)")
    return np.asarray(slots[:num_contexts]), np.asarray(slots[num_contexts:]).reshape(gen // beam_width, beam_width)


def half_block_views(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one GQA layer, ``[num_blocks, Hkv, P, D]`` views of its pool with any strides
    (kvsieve's HND or NHD pool through ``k_cache(layer)``/``v_cache(layer)``, or a foreign engine's
    layout through :class:`~kvsieve.metadata.ForeignPagedKV`), as two ``[2*num_blocks - 1, Hkv, P, D]``
    views addressed by half-block offsets: the block stride is halved, so offset ``2*b`` of the first
    view is K of block ``b`` and the same offset of the second is V of block ``b`` (odd offsets are
    never addressed). A reader takes one table, :attr:`BlockOffsetTable.k_offsets`. Raises
    ``ValueError`` when a block stride is odd (no half-block addressing exists) or the two differ."""
    s0 = k_cache.stride(0)
    if s0 % 2 or v_cache.stride(0) != s0 or k_cache.shape[0] != v_cache.shape[0]:
        raise ValueError(f"half_block_views: K and V need the same even block stride and block count, got "
                         f"strides {k_cache.stride(0)}/{v_cache.stride(0)}, blocks {k_cache.shape[0]}/{v_cache.shape[0]}")
    n = 2 * k_cache.shape[0] - 1
    return tuple(t.as_strided((n, *t.shape[1:]), (s0 // 2, *t.stride()[1:]), t.storage_offset())
                 for t in (k_cache, v_cache))
