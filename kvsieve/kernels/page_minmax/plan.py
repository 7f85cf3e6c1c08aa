"""The entry point of :mod:`kvsieve.kernels.page_minmax` (the contract is there): the native kernel
where it takes the inputs and its library is available, else the plain twin."""
from __future__ import annotations

import numpy as np
import torch

from ..common.native import NativeUnavailable
from .naive import page_minmax_naive
from .native import MAX_D, page_minmax_native

__all__ = ["page_minmax", "supports_native"]

_DTYPES = (torch.float32, torch.bfloat16)


def supports_native(keys: torch.Tensor, pool: torch.Tensor) -> bool:
    """Whether the native kernel takes these tensors (its library may still be unavailable)."""
    return (keys.device.type == pool.device.type == "cpu" and keys.dtype in _DTYPES and pool.dtype in _DTYPES
            and keys.dim() == 4 and pool.dim() == 5 and 1 <= keys.shape[3] <= MAX_D
            and pool.stride(4) == 1)


def page_minmax(keys: torch.Tensor, blocks: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                pool: torch.Tensor) -> str:
    """Write the summaries of the listed pages into ``pool`` (module docstring); the engine that ran."""
    if supports_native(keys, pool):
        try:
            page_minmax_native(keys, *(np.ascontiguousarray(a, dtype=np.int64) for a in (blocks, starts, counts)),
                               pool)
            return "native"
        except NativeUnavailable:
            pass
    page_minmax_naive(keys, blocks, starts, counts, pool)
    return "naive"
