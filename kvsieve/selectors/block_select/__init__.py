"""Block select: mean-key block summaries scored against the query, top blocks (or top-p mass) attended.

Shared page machinery: :mod:`kvsieve.selectors.common`. Kernels: none of its own.
"""
from __future__ import annotations

from .selector import BlockSelectConfig, BlockSelectSelector

__all__ = ["BlockSelectConfig", "BlockSelectSelector"]
