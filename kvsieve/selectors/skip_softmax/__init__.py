"""Skip-softmax: no indices; the kernels skip a KV tile whose scores fall below a threshold.

Kernels: :mod:`kvsieve.kernels.triton.sparse_gqa_decode`, :mod:`kvsieve.kernels.triton.paged_prefill`,
:mod:`kvsieve.kernels.cute.sparse_gqa_decode`, :mod:`kvsieve.kernels.cpu.sparse_decode`, and the torch
backend's tile loop (:mod:`kvsieve.sparse.backends.skip_tiling`). Calibrating the factor on a
model: the ``calibrate_skip_softmax`` prepare step (:mod:`.prepare`).
"""
from __future__ import annotations

from . import prepare as _prepare  # noqa: F401  (registers the calibrate_skip_softmax prepare step)
from .selector import SkipSoftmaxConfig, SkipSoftmaxSelector

__all__ = ["SkipSoftmaxConfig", "SkipSoftmaxSelector"]
