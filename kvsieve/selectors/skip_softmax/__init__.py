"""Skip-softmax: no indices; the kernels skip a KV tile whose scores fall below a threshold.

Kernels: :mod:`kvsieve.kernels.sparse_gqa_decode` (Triton, CuTe-DSL and native CPU),
:mod:`kvsieve.kernels.paged_prefill`, and the torch
backend's tile loop (:mod:`kvsieve.sparse.backends.skip_tiling`). Calibrating the factor on a
model: the ``calibrate_skip_softmax`` calibration step (:mod:`.calibration`).
"""
from __future__ import annotations

from . import calibration as _calibration  # noqa: F401  (registers the calibrate_skip_softmax calibration step)
from .selector import SkipSoftmaxConfig, SkipSoftmaxSelector

__all__ = ["SkipSoftmaxConfig", "SkipSoftmaxSelector"]
