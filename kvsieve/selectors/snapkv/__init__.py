"""SnapKV: the prompt keys most attended by an observation window are kept; the rest are dropped.

Shared machinery: :mod:`kvsieve.selectors.common.prefill_scoring`. Kernels: none of its own.
"""
from __future__ import annotations

from .selector import SnapKVConfig, SnapKVSelector

__all__ = ["SnapKVConfig", "SnapKVSelector"]
