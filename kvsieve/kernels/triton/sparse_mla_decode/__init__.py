"""Sparse absorbed-MLA decode (latent cache, head groups per program, split-K)."""
from __future__ import annotations

from .kernel import sparse_mla_decode

__all__ = ["sparse_mla_decode"]
