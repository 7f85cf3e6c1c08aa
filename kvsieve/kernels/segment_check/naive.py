"""The plain checks of a selection carrier's ``(indices, offsets)`` pair (the contract is in
:mod:`..segment_check`): torch for the offsets, numpy for the segments; each raises ``ValueError``
naming the first entry that breaks a rule."""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["check_offsets_naive", "check_segments_naive"]


def check_offsets_naive(prefix: str, indices: torch.Tensor, offsets: torch.Tensor) -> None:
    """``offsets`` start at 0, never decrease and end at ``indices.shape[1]``."""
    iname, oname = f"{prefix}_indices", f"{prefix}_offsets"
    off = offsets.to("cpu", torch.int64)
    if int(off[0]) != 0:
        raise ValueError(f"{oname}[0] must be 0, got {int(off[0])}")
    if bool((off[1:] < off[:-1]).any()):
        bad = int(torch.nonzero(off[1:] < off[:-1])[0])
        raise ValueError(f"{oname} must be non-decreasing; {oname}[{bad + 1}] < {oname}[{bad}]")
    if int(off[-1]) != indices.shape[1]:
        raise ValueError(f"{oname}[-1]={int(off[-1])} must equal {iname}.shape[1]={indices.shape[1]}")


def check_segments_naive(
    name: str,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    valid_lens: torch.Tensor | None,
    *,
    block_size: int,
    allow_padding: bool,
) -> None:
    """Range, padding and strict ascending order of each (head, row) segment, vectorized (numpy on
    the host). ``name`` is the indices' name (``"sparse_attn_indices"``)."""
    idx = indices.to("cpu", torch.int64).numpy()
    off = offsets.to("cpu", torch.int64).numpy()
    if idx.size == 0:
        return
    lowest = -1 if allow_padding else 0
    if bool((idx < lowest).any()):
        what = "-1 (padding) or a position >= 0" if allow_padding else "a position >= 0"
        raise ValueError(f"{name} entries must be {what}; found {int(idx.min())}")
    total = idx.shape[1]
    row_of = np.repeat(np.arange(off.size - 1), np.diff(off))
    valid = idx >= 0
    if valid_lens is not None:
        lens = valid_lens.to("cpu", torch.int64).numpy()
        if lens.size != off.size - 1:
            raise ValueError(f"{name}: expected {off.size - 1} valid lengths, got {lens.size}")
        limit = (lens[row_of] + block_size - 1) // block_size
        over = valid & (idx >= limit[None, :])
        if bool(over.any()):
            h, j = (int(v) for v in np.argwhere(over)[0])
            unit = "token" if block_size == 1 else f"block (size {block_size})"
            raise ValueError(
                f"{name}[{h}, {j}]={int(idx[h, j])} is out of range: row {int(row_of[j])} has "
                f"{int(limit[j])} valid {unit} positions"
            )
    if total < 2:
        return
    same_row = (row_of[1:] == row_of[:-1])[None, :]
    both_valid = valid[:, 1:] & valid[:, :-1]
    unsorted = same_row & both_valid & (idx[:, 1:] <= idx[:, :-1])
    if bool(unsorted.any()):
        h, j = (int(v) for v in np.argwhere(unsorted)[0])
        raise ValueError(
            f"{name} must be strictly ascending (sorted, unique) within each (head, row) segment; "
            f"[{h}, {j}]={int(idx[h, j])} then [{h}, {j + 1}]={int(idx[h, j + 1])}"
        )
    if allow_padding:
        # padding only at the tail of a segment: a valid entry may not follow a -1
        after_pad = same_row & valid[:, 1:] & ~valid[:, :-1]
        if bool(after_pad.any()):
            h, j = (int(v) for v in np.argwhere(after_pad)[0])
            raise ValueError(f"{name}: -1 padding must trail each segment; valid entry after -1 at [{h}, {j + 1}]")