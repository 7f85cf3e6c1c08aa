"""Skip-softmax: no indices; the kernels skip a KV tile whose scores fall below a threshold.

Kernels: :mod:`kvsieve.kernels.sparse_gqa_decode` (Triton, CuTe-DSL and native CPU),
:mod:`kvsieve.kernels.paged_prefill`, and the torch
backend's tile loop (:mod:`kvsieve.sparse.backends.skip_tiling`).
"""
from __future__ import annotations

from .selector import SkipSoftmaxConfig, SkipSoftmaxSelector

__all__ = ["SkipSoftmaxConfig", "SkipSoftmaxSelector"]
