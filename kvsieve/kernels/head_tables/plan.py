"""The entry point of :mod:`kvsieve.kernels.head_tables` (the contract is there): the native kernel
where it takes the inputs and its library is available, else the plain twin."""
from __future__ import annotations

import numpy as np

from ..common.native import NativeUnavailable
from .naive import head_tables_naive
from .native import head_tables_native

__all__ = ["head_tables"]


def head_tables(indices: np.ndarray, offsets: np.ndarray, table: np.ndarray, kv_lens: np.ndarray,
                block_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The pseudo-block tables and lengths (module docstring)."""
    if indices.shape[1] != int(offsets[-1]) or table.shape[0] != offsets.size - 1 or kv_lens.size != table.shape[0]:
        raise ValueError(f"head_tables: {offsets.size - 1} rows need offsets ending at indices' width "
                         f"{indices.shape[1]} (got {int(offsets[-1])}), {offsets.size - 1} table rows (got "
                         f"{table.shape[0]}) and lengths (got {kv_lens.size})")
    if offsets.size == 1:
        return None
    # the builders take int32 with contiguous rows (a 2-D array may be a column slice)
    indices, table = (a if a.dtype == np.int32 and a.strides[-1] == 4 else np.ascontiguousarray(a, dtype=np.int32)
                      for a in (indices, table))
    offsets, kv_lens = (np.ascontiguousarray(a, dtype=np.int32) for a in (offsets, kv_lens))
    try:
        return head_tables_native(indices, offsets, table, kv_lens, block_size)
    except NativeUnavailable:
        return head_tables_naive(indices, offsets, table, kv_lens, block_size)
