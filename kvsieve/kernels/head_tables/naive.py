"""Plain numpy twin of :func:`~kvsieve.kernels.head_tables.plan.head_tables` (the contract is there)."""
from __future__ import annotations

import numpy as np

__all__ = ["OUT_OF_RANGE", "head_tables_naive"]

OUT_OF_RANGE = ("head_tables: a selected block starts at or past its row's kv_len, or past its table row "
                "(the selection is not validated against the rows' lengths)")


def head_tables_naive(indices: np.ndarray, offsets: np.ndarray, table: np.ndarray, kv_lens: np.ndarray,
                      block_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``(pseudo [n * H, width] int32, seq_lens [n * H] int32)`` or ``None``."""
    heads, n = indices.shape[0], offsets.size - 1
    row_of = np.repeat(np.arange(n), np.diff(offsets))
    limit = np.minimum(-(-kv_lens.astype(np.int64) // block_size), table.shape[1])[row_of]
    if bool(((indices >= 0) & (indices >= limit[None, :])).any()):
        raise ValueError(OUT_OF_RANGE)
    counts = np.diff(offsets)
    width = int(counts.max())
    pages = np.full((heads, n, width), -1, dtype=np.int64)
    pages[:, np.arange(width)[None, :] < counts[:, None]] = indices
    pages = np.where(pages < 0, np.iinfo(np.int64).max, pages)
    pages.sort(axis=-1)  # ascending valid entries first, the padding after them
    valid = pages != np.iinfo(np.int64).max
    num = valid.sum(-1)  # [H, n]
    if bool((num == 0).any()):
        return None
    pages = np.where(valid, pages, 0)
    blocks = np.take_along_axis(table[None].astype(np.int64), pages, axis=2)  # [H, n, width]
    heads_col = np.arange(heads, dtype=np.int64)[:, None, None]
    pseudo = np.where(valid, blocks * heads + heads_col, 0)
    last = np.take_along_axis(pages, (num - 1)[..., None], axis=2)[..., 0]  # [H, n]
    seq = (num - 1) * block_size + np.minimum(kv_lens.astype(np.int64)[None, :] - last * block_size, block_size)
    return (np.ascontiguousarray(pseudo.transpose(1, 0, 2).reshape(n * heads, width).astype(np.int32)),
            np.ascontiguousarray(seq.T.reshape(-1).astype(np.int32)))
