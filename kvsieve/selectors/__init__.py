"""Built-in selectors, one module per algorithm; importing this package registers them."""
from __future__ import annotations

from .oracle_topk import OracleTopKConfig, OracleTopKSelector
from .streaming import StreamingConfig, StreamingSelector

__all__ = ["OracleTopKConfig", "OracleTopKSelector", "StreamingConfig", "StreamingSelector"]
