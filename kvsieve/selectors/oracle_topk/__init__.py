"""Oracle top-k: the exact top-k of the dense attention scores (an upper bound for the other selectors).

Kernels: none of its own; the attention backends consume the carrier it writes.
"""
from __future__ import annotations

from .selector import OracleTopKConfig, OracleTopKSelector

__all__ = ["OracleTopKConfig", "OracleTopKSelector"]
