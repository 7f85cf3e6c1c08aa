"""The entry point of :mod:`kvsieve.kernels.segment_check` (the contract is there): the native kernel
where it takes the inputs and its library is available, else the plain twin."""
from __future__ import annotations

import numpy as np
import torch

from ..common.native import NativeUnavailable
from .naive import check_offsets_naive, check_segments_naive
from .native import segment_check_native

__all__ = ["check_segments"]


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
