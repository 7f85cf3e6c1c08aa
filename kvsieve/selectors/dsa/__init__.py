"""DeepSeek Sparse Attention: a learned lightning indexer scores every key; its top-k are attended.

Indexer projections: :mod:`.projections`; training them for a GQA model (the dense warm-up):
:mod:`.distill`, run by the ``distill_indexer`` calibration step (:mod:`.calibration`) and by
``kvsieve distill-indexer``. Kernels: :mod:`kvsieve.kernels.dsa_indexer`,
:mod:`kvsieve.kernels.topk` (Triton and CuTe-DSL engines), :mod:`kvsieve.kernels.sparse_mla_decode`.
"""
from __future__ import annotations

from . import calibration as _calibration  # noqa: F401  (registers the distill_indexer calibration step)
from .projections import IndexerInputs
from .selector import DSAConfig, DSASelector

__all__ = ["DSAConfig", "DSASelector", "IndexerInputs"]
