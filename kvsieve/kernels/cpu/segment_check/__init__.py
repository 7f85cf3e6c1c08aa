"""The checks of a selection carrier's ``(indices, offsets)`` pair (``SparseRuntimeParams.validate``),
on the host: the native C checker beside its plain ``naive`` twin.

Rules, for ``indices [H, total]`` int32 and ``offsets [n + 1]`` int32 (row ``r``, head ``h`` owns
``indices[h, offsets[r]:offsets[r + 1]]``):

1. ``offsets[0] == 0``, non-decreasing, ``offsets[-1] == total``;
2. every entry ``>= -1`` with padding allowed (``-1`` = padding), else ``>= 0``;
3. with ``lens [n]`` given, every valid entry ``< ceil(lens[r] / block_size)``;
4. the valid entries of each (head, row) segment strictly ascending (sorted, unique);
5. with padding, the ``-1`` entries of a segment after its valid ones.

:func:`check_segments` raises ``ValueError`` naming the first entry that breaks a rule, or returns.
The native checker decides in one pass over the entries (a decode step's few hundred: about a
microsecond, where the plain path costs a dozen array ops); when it finds a broken rule, or its
library is unavailable, or the tensors are not CPU int32, the plain path runs and names the entry.
"""
from __future__ import annotations

import numpy as np
import torch

from ..build import NativeUnavailable
from .naive import check_offsets_naive, check_segments_naive
from .native import SOURCE, segment_check_native

__all__ = ["SOURCE", "check_offsets_naive", "check_segments", "check_segments_naive", "segment_check_native"]


def check_segments(prefix: str, indices: torch.Tensor, offsets: torch.Tensor, lens: torch.Tensor | None, *,
                   block_size: int, allow_padding: bool) -> None:
    """Rules 1-5 (module docstring) of ``{prefix}_indices`` / ``{prefix}_offsets``; the pair's dtype,
    shape and device are checked before (``SparseRuntimeParams.validate``). ``lens`` int ``[n]`` or
    ``None`` (no range check)."""
    if lens is not None and lens.numel() != offsets.numel() - 1:
        raise ValueError(f"{prefix}_indices: expected {offsets.numel() - 1} valid lengths, got {lens.numel()}")
    broken = None
    if indices.device.type == "cpu" and offsets.device.type == "cpu" and indices.dtype == offsets.dtype == torch.int32:
        idx = indices.numpy()
        if idx.strides[1] != 4:
            idx = np.ascontiguousarray(idx)
        host_lens = None if lens is None else np.ascontiguousarray(lens.to("cpu").numpy(), dtype=np.int64)
        try:
            broken = segment_check_native(idx, np.ascontiguousarray(offsets.numpy()), host_lens,
                                          block_size=block_size, lowest=-1 if allow_padding else 0)
        except NativeUnavailable:
            broken = None
        if broken == 0:
            return
    check_offsets_naive(prefix, indices, offsets)
    check_segments_naive(f"{prefix}_indices", indices, offsets, lens, block_size=block_size,
                         allow_padding=allow_padding)
    if broken:  # the checker and the plain path disagree: a bug in one of them, never an accepted input
        raise RuntimeError(f"kvsieve segment_check: the native checker found rule {broken} broken in "
                           f"{prefix}_indices, the plain checks found nothing")
