"""StreamingLLM: the first ``num_sink`` and the last ``num_recent`` positions of every request.

Kernels: none of its own; the attention backends consume the carrier it writes.
"""
from __future__ import annotations

from .selector import StreamingConfig, StreamingSelector

__all__ = ["StreamingConfig", "StreamingSelector"]
