"""The C kernel of :func:`~kvsieve.kernels.page_minmax.plan.page_minmax` (``page_minmax.c``) behind ctypes."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from ..common.native import native_library
from .naive import OUT_OF_RANGE

__all__ = ["MAX_D", "SOURCE", "page_minmax_native"]

SOURCE = Path(__file__).with_name("page_minmax.c")
MAX_D = 1024  # as in page_minmax.c
_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_ARGTYPES = [_P, _I, _I64, _I64, _I64, _I64, _I64, _I, _I, _I, _P, _P, _P, _I64, _I, _P, _I, _I64, _I64, _I64, _I64]


def page_minmax_native(keys: torch.Tensor, blocks: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                       pool: torch.Tensor) -> None:
    """As :func:`~.naive.page_minmax_naive`; the caller has checked that the tensors are what the
    kernel takes (``supports_native``); ``blocks``/``starts``/``counts`` contiguous int64."""
    fn = native_library(SOURCE).kvsieve_page_minmax
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    nb, hkv, bs, d = keys.shape
    rc = fn(keys.data_ptr(), int(keys.dtype == torch.bfloat16), *keys.stride(), nb, hkv, bs, d,
            blocks.ctypes.data, starts.ctypes.data, counts.ctypes.data, blocks.size, bs // pool.shape[2],
            pool.data_ptr(), int(pool.dtype == torch.bfloat16), *pool.stride()[:4])
    if rc == 2:
        raise ValueError(OUT_OF_RANGE)
    if rc != 0:
        raise RuntimeError(f"kvsieve_page_minmax returned {rc} (keys {tuple(keys.shape)})")
