"""Per-(row, KV head) block tables of a whole-block selection, for a host engine's paged kernel
(the vLLM plug-in's ``host_paged`` path): the native C builder beside its plain ``naive`` twin.

Inputs (host numpy, int32):

* ``indices [H, total]`` and ``offsets [n + 1]``: the ``n`` rows' block selections (a carrier's
  ``sparse_attn_indices`` / ``sparse_attn_offsets`` cut to those rows, block size = the cache's
  block), validated: per (head, row) the valid block indices ascending, ``-1`` padding after them;
* ``table [n, W]``: each row's request's physical block ids in order;
* ``kv_lens [n]``: positions in each row's request.

:func:`head_tables` returns ``(pseudo [n * H, width], seq_lens [n * H])`` int32, or ``None`` when
some (row, head) selects no block; a selected block at or past its row's length (or its table row)
raises ``ValueError`` (both builders check it: nothing outside the table is read). Pseudo-request ``r * H + h`` reads the pseudo-blocks
``block * H + h`` of its selected blocks, in order (``width`` = the longest segment; entries past
its own blocks are 0 and not read), and ``seq_lens`` positions of them: every selected block whole
but the last, which ends at the request's length (only a request's newest block is partial). The
native builder writes them in one pass (about a microsecond for a decode step); the naive twin
(a dozen numpy ops) runs where its library is unavailable.
"""
from __future__ import annotations

import numpy as np

from ..build import NativeUnavailable
from .naive import head_tables_naive
from .native import SOURCE, head_tables_native

__all__ = ["SOURCE", "head_tables", "head_tables_naive", "head_tables_native"]


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
