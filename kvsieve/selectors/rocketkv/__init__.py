"""RocketKV: SnapKV-style prompt pruning at prefill, then Quest-style page selection at decode.

Shared machinery: :mod:`kvsieve.selectors.common`. Kernels: :mod:`kvsieve.kernels.page_topk`.
"""
from __future__ import annotations

from .selector import RocketKVConfig, RocketKVSelector

__all__ = ["RocketKVConfig", "RocketKVSelector"]
