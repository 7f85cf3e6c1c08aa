"""The torch backend's grow-only gather buffers, reused across calls.

A fresh multi-MiB tensor per call is a fresh mmap, and its page faults cost several times the copy
itself; the pool keeps one buffer per (name, dtype, device) and hands out views of its prefix. The
backend bounds what it asks for by ``max_gather_bytes``.
"""
from __future__ import annotations

import math

import torch

__all__ = ["ScratchPool"]


class ScratchPool:
    """Named, grow-only scratch buffers (one per name, dtype and device)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised ``shape`` view of buffer ``name`` (grown when too small)."""
        numel = math.prod(shape)
        key = (name, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel].view(shape)

    def rows(self, name: str, flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``flat.index_select(0, index)`` (``flat`` 2-D ``[rows, width]``, ``index`` int64 ``[n]``)
        into buffer ``name``, then fp32 ``[n, width]`` (no copy for an fp32 ``flat``)."""
        out = self.buffer(name, (index.numel(), flat.shape[1]), flat.dtype, flat.device)
        torch.index_select(flat, 0, index, out=out)
        if flat.dtype == torch.float32:
            return out
        return self.buffer(name + "_f32", tuple(out.shape), torch.float32, flat.device).copy_(out)
