"""CuTe-DSL sparse paged GQA decode at block granularity (SM90 wgmma / SM100 tcgen05)."""
from __future__ import annotations

from .host import sparse_gqa_decode

__all__ = ["sparse_gqa_decode"]
