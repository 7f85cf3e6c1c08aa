"""vLLM's per-layer KV cache tensors as kvsieve K/V views ``[num_blocks, Hkv, block_size, D]``
(strided, no copy). Free of vLLM imports, so the views are testable without vLLM.

* ``vllm-cpu`` (``CPU_ATTN``, ISAs ``vec``/``vec16``): one tensor ``[num_blocks, Hkv, block_size,
  2*D]``; per (block, head) the first ``block_size*D`` elements hold K *transposed*
  (``[D, block_size]``: element ``(p, d)`` at ``d*block_size + p``), the next ``block_size*D`` hold
  V as ``[block_size, D]``. The ``amx`` ISA packs K for AMX tiles instead; the plug-in makes vLLM
  use ``vec`` so the cache stays viewable (:func:`probe_cpu_layout` checks it at start-up).
* ``vllm-triton`` (CUDA ``TRITON_ATTN``, vLLM 0.32): the logical ``[num_blocks, Hkv, block_size,
  2*D]`` (physical strides HND or NHD), K in the first ``D`` channels, V in the last ``D``.
"""
from __future__ import annotations

import torch

__all__ = ["LAYOUTS", "kv_views"]


def _cpu(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, h, p, two_d = cache.shape
    d = two_d // 2
    if two_d != 2 * d or not cache.is_contiguous():
        raise ValueError(f"vllm-cpu cache must be a contiguous [num_blocks, Hkv, block_size, 2*D], got "
                         f"{list(cache.shape)} (contiguous={cache.is_contiguous()})")
    flat = cache.view(n, h, 2, p * d)
    k = flat[:, :, 0].view(n, h, d, p).transpose(2, 3)  # K stored [D, block_size]
    v = flat[:, :, 1].view(n, h, p, d)
    return k, v


def _triton(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if cache.dim() != 4 or cache.shape[-1] % 2:
        raise ValueError(f"vllm-triton cache must be [num_blocks, Hkv, block_size, 2*D], got {list(cache.shape)}")
    d = cache.shape[-1] // 2
    return cache[..., :d], cache[..., d:]


LAYOUTS = {"vllm-cpu": _cpu, "vllm-triton": _triton}


def kv_views(layout: str, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer's cache as ``[num_blocks, Hkv, block_size, D]`` views of ``cache``."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown vLLM cache layout {layout!r}; known: {sorted(LAYOUTS)}")
    return LAYOUTS[layout](cache)
