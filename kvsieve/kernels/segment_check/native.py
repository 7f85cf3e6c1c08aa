"""The C checker of :func:`~kvsieve.kernels.segment_check.plan.check_segments` (``segment_check.c``)
behind ctypes."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from ..common.native import native_library

__all__ = ["SOURCE", "segment_check_native"]

SOURCE = Path(__file__).with_name("segment_check.c")
_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_ARGTYPES = [_P, _I64, _I, _I64, _P, _I64, _P, _I, _I]


def segment_check_native(indices: np.ndarray, offsets: np.ndarray, lens: np.ndarray | None, *, block_size: int,
                         lowest: int) -> int:
    """0 when every rule holds, else the number of the first rule broken (``segment_check.c``):
    ``indices`` int32 ``[H, total]`` (rows contiguous), ``offsets`` int32 ``[n + 1]`` contiguous,
    ``lens`` int64 ``[n]`` contiguous or ``None``; the caller has checked the shapes."""
    fn = native_library(SOURCE).kvsieve_segment_check
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    return fn(indices.ctypes.data, indices.strides[0] // 4, indices.shape[0], indices.shape[1], offsets.ctypes.data,
              offsets.size - 1, None if lens is None else lens.ctypes.data, block_size, lowest)
