"""A selection of decode rows as runs of a paged cache (the input of
:func:`~kvsieve.kernels.sparse_gqa_decode.native.sparse_decode_runs_native`): :func:`selection_runs`
is the C builder (``kvsieve_selection_runs`` in ``sparse_gqa_decode.c``, one pass over the entries)
where its library is available, else its numpy twin :func:`selection_runs_naive` (a fixed number of
vectorized ops whatever the number of rows, heads or selected positions); both return the same runs.
"""
from __future__ import annotations

import ctypes
import math
from pathlib import Path

import numpy as np

from ..common.native import NativeUnavailable, native_library
from ..common.runs import TokenRuns

__all__ = ["TokenRuns", "selection_runs", "selection_runs_naive"]

_SOURCE = Path(__file__).with_name("sparse_gqa_decode.c")  # the library of .native
_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_ARGTYPES = [_P, _I64, _P, _I64, _I, _I, _I, _P, _I64, _I64, _P, _I, _I64, _P, _P, _P, _P, _P, _P]


def selection_runs(indices: np.ndarray, offsets: np.ndarray, units_of: int, table: np.ndarray,
                   kv_lens: np.ndarray, block_size: int) -> TokenRuns:
    """Runs of ``num_rows`` decode rows' selection (arguments as :func:`selection_runs_naive`), by the
    C builder; its numpy twin where the library is unavailable or ``indices`` is not int32 with
    contiguous entries."""
    if indices.dtype != np.int32 or indices.strides[1] != 4:
        return selection_runs_naive(indices, offsets, units_of, table, kv_lens, block_size)
    try:
        fn = native_library(_SOURCE).kvsieve_selection_runs
    except NativeUnavailable:
        return selection_runs_naive(indices, offsets, units_of, table, kv_lens, block_size)
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int64
    hkv, rows = indices.shape[0], offsets.size - 1
    unit = math.gcd(units_of, block_size)
    most = indices.shape[1] * (units_of // unit) * hkv  # every piece its own run
    off = np.ascontiguousarray(offsets, dtype=np.int64)
    tab = table if table.dtype == np.int32 and table.strides[1] == 4 else np.ascontiguousarray(table, dtype=np.int32)
    lens = np.ascontiguousarray(kv_lens, dtype=np.int32)
    ptr = np.empty(hkv * rows + 1, dtype=np.int64)
    block, head, start = (np.empty(most, dtype=np.int64) for _ in range(3))
    cnt = np.empty(most, dtype=np.int32)
    attended = np.empty((rows, hkv), dtype=np.int64)
    n = fn(indices.ctypes.data, indices.strides[0] // 4, off.ctypes.data, rows, hkv, units_of, unit, tab.ctypes.data,
           tab.strides[0] // 4, tab.shape[1], lens.ctypes.data, block_size, most, ptr.ctypes.data, block.ctypes.data,
           head.ctypes.data, start.ctypes.data, cnt.ctypes.data, attended.ctypes.data)
    if n < 0:
        raise ValueError(f"selection_runs: a selected position lies past its row's block table (code {n})")
    return TokenRuns(ptr=ptr, block=block[:n], head=head[:n], start=start[:n], cnt=cnt[:n], attended=attended)


def selection_runs_naive(indices: np.ndarray, offsets: np.ndarray, units_of: int, table: np.ndarray,
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
