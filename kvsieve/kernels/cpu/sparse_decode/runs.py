"""A selection of decode rows as runs of a paged cache (the input of
:func:`~kvsieve.kernels.cpu.sparse_decode.sparse_decode_runs_native`), built on the host with a
fixed number of vectorized numpy ops whatever the number of rows, heads or selected positions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["TokenRuns", "selection_runs"]


@dataclass(frozen=True)
class TokenRuns:
    """Runs of consecutive cache positions inside one cache block, grouped by (KV head, row):
    the runs of row ``n`` and KV head ``h`` are ``[ptr[h * num_rows + n], ptr[h * num_rows + n + 1])``,
    in ascending position order.

    ``ptr [Hkv * num_rows + 1]`` int64; per run ``block`` (physical cache block), ``head`` (its KV
    head), ``start`` (first token inside the block) int64 ``[R]`` and ``cnt`` (tokens) int32 ``[R]``;
    ``attended [num_rows, Hkv]`` int64: the positions each (row, KV head) reads (the sum of its runs)."""

    ptr: np.ndarray
    block: np.ndarray
    head: np.ndarray
    start: np.ndarray
    cnt: np.ndarray
    attended: np.ndarray

    @property
    def num_rows(self) -> int:
        return self.attended.shape[0]


def selection_runs(indices: np.ndarray, offsets: np.ndarray, units_of: int, table: np.ndarray,
                   kv_lens: np.ndarray, block_size: int) -> TokenRuns:
    """Runs of ``num_rows`` decode rows' selection.

    ``indices [Hkv, W]`` int32 and ``offsets [num_rows + 1]`` (from 0 to ``W``): row ``n`` and KV head
    ``h`` select ``indices[h, offsets[n]:offsets[n+1]]``, ascending, unique, ``-1`` padding at the
    tail (a validated :class:`~kvsieve.sparse.SparseRuntimeParams` segment); each entry is a unit of
    ``units_of`` positions ``[i * units_of, (i + 1) * units_of)``, clipped to the row's ``kv_lens[n]``.
    ``table [num_rows, >= blocks]`` int32: the row's physical cache blocks of ``block_size`` tokens.
    Consecutive selected positions inside one cache block are one run."""
    hkv = indices.shape[0]
    rows = offsets.size - 1
    row_of = np.repeat(np.arange(rows), np.diff(offsets))  # [W]
    sel = indices.astype(np.int64)
    unit = math.gcd(units_of, block_size)  # a unit never straddles two cache blocks
    if units_of != unit:  # a selected unit is several of `unit` positions
        per = units_of // unit
        sel = np.where(sel[..., None] < 0, -1, sel[..., None] * per + np.arange(per)).reshape(hkv, -1)
        row_of = np.repeat(row_of, per)
    pos = sel * unit
    lens = kv_lens.astype(np.int64)[row_of]  # [W']
    head, col = np.nonzero((sel >= 0) & (pos < lens))  # head-major, then rows, then ascending positions
    pos, row, lens = pos[head, col], row_of[col], lens[col]
    cnt = np.minimum(lens - pos, unit)
    blk = pos // block_size
    new = np.ones(pos.size, dtype=bool)
    new[1:] = (head[1:] != head[:-1]) | (row[1:] != row[:-1]) | (pos[1:] != pos[:-1] + unit) | (blk[1:] != blk[:-1])
    first = np.flatnonzero(new)
    run_cnt = np.add.reduceat(cnt, first) if first.size else cnt[:0]
    run_head, run_row = head[first], row[first]
    group = run_head * rows + run_row
    ptr = np.zeros(hkv * rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(group, minlength=hkv * rows), out=ptr[1:])
    attended = np.bincount(group, weights=run_cnt, minlength=hkv * rows).astype(np.int64).reshape(hkv, rows).T
    return TokenRuns(ptr=ptr, block=table[run_row, blk[first]].astype(np.int64), head=run_head,
                     start=pos[first] % block_size, cnt=run_cnt.astype(np.int32), attended=np.ascontiguousarray(attended))
