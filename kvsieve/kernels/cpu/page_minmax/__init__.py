"""Min/max key summaries of cache pages (Quest's and RocketKV's page summaries, refreshed when
tokens land in a page), on the CPU: the native C kernel beside its plain-PyTorch twin.

* ``keys [num_blocks, Hkv, block_size, D]``: one layer's K cache, any strides (channels
  contiguous, or tokens as in vLLM's CPU layout); fp32 or bf16 for the native kernel.
* ``blocks``, ``starts``, ``counts`` int64 numpy ``[n]``: page ``i`` is the ``counts[i]`` keys from
  token ``starts[i]`` of block ``blocks[i]``; ``starts[i]`` a multiple of ``page_size``,
  ``1 <= counts[i] <= page_size``, the page inside its block.
* ``pool [num_blocks, Hkv, block_size // page_size, 2, D]``: the summary pool (``[..., 0, :]`` =
  min, ``1`` = max), fp32 or bf16 for the native kernel, channel dimension contiguous; page ``i``
  writes ``pool[blocks[i], :, starts[i] // page_size]``, nothing else is written.

The min and max are taken in fp32 and rounded to the pool's dtype (round to nearest-even), so the
native kernel writes the values the twin writes (a min or a max of the inputs is one of them: no
sum, no order; only a zero's sign may differ where +0 and -0 tie). :func:`page_minmax` returns ``"native"`` or ``"naive"``: the native kernel runs
for CPU tensors of those dtypes and ``D <= 1024`` when its library builds (:mod:`..build`); it
refuses a page outside its block with a ``ValueError`` before writing anything.
"""
from __future__ import annotations

import numpy as np
import torch

from ..build import NativeUnavailable
from .naive import page_minmax_naive
from .native import MAX_D, SOURCE, page_minmax_native

__all__ = ["SOURCE", "page_minmax", "page_minmax_naive", "page_minmax_native", "supports_native"]

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
