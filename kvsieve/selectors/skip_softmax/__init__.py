"""Skip-softmax: no indices; the kernels skip a KV tile whose scores fall below a threshold.

Kernels: :mod:`kvsieve.kernels.sparse_gqa_decode` (Triton, CuTe-DSL and native CPU),
:mod:`kvsieve.kernels.paged_prefill`, and the torch
backend's tile loop (:mod:`kvsieve.sparse.backends.skip_tiling`). Calibrating the factor on a
model: the ``calibrate_skip_softmax`` prepare step (:mod:`.prepare`).
"""
from __future__ import annotations

from . import prepare as _prepare  # noqa: F401  (registers the calibrate_skip_softmax prepare step)
from .selector import SkipSoftmaxConfig, SkipSoftmaxSelector

__all__ = ["SkipSoftmaxConfig", "SkipSoftmaxSelector"]
