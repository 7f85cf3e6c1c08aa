"""Sparse/dense paged GQA decode (gather attention with split-K and skip-softmax)."""
from __future__ import annotations

from .kernel import sparse_gqa_decode

__all__ = ["sparse_gqa_decode"]
