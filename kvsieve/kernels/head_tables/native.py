"""The C builder of :func:`~kvsieve.kernels.head_tables.plan.head_tables` (``head_tables.c``) behind ctypes."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from ..common.native import native_library
from .naive import OUT_OF_RANGE

__all__ = ["SOURCE", "head_tables_native"]

SOURCE = Path(__file__).with_name("head_tables.c")
_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_ARGTYPES = [_P, _I64, _I, _P, _I64, _P, _I64, _I64, _P, _I, _I64, _P, _P]


def head_tables_native(indices: np.ndarray, offsets: np.ndarray, table: np.ndarray, kv_lens: np.ndarray,
                       block_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """As :func:`~.naive.head_tables_naive`; int32 inputs whose rows are contiguous."""
    fn = native_library(SOURCE).kvsieve_head_tables
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    heads, n = indices.shape[0], offsets.size - 1
    width = int((offsets[1:] - offsets[:-1]).max())
    pseudo = np.empty((n * heads, width), dtype=np.int32)
    seq = np.empty(n * heads, dtype=np.int32)
    code = fn(indices.ctypes.data, indices.strides[0] // 4, heads, offsets.ctypes.data, n, table.ctypes.data,
               table.strides[0] // 4, table.shape[1], kv_lens.ctypes.data, block_size, width, pseudo.ctypes.data, seq.ctypes.data)
    if code == 2:
        raise ValueError(OUT_OF_RANGE)
    return None if code else (pseudo, seq)
