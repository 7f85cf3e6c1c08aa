"""DeepSeek Sparse Attention: a learned lightning indexer scores every key; its top-k are attended.

Indexer projections: :mod:`.projections`; training them for a GQA model:
:mod:`kvsieve.eval.distill_indexer`. Kernels: :mod:`kvsieve.kernels.triton.dsa_indexer`,
:mod:`kvsieve.kernels.triton.topk`, :mod:`kvsieve.kernels.cute.topk_gvr`,
:mod:`kvsieve.kernels.triton.sparse_mla_decode`, :mod:`kvsieve.kernels.cute.sparse_mla_decode`.
"""
from __future__ import annotations

from .projections import IndexerInputs
from .selector import DSAConfig, DSASelector

__all__ = ["DSAConfig", "DSASelector", "IndexerInputs"]
