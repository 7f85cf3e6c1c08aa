"""Quest: per-page min/max key summaries, the pages with the highest upper bound are attended.

Shared page machinery: :mod:`kvsieve.selectors.common`. Kernels: :mod:`kvsieve.kernels.page_topk`.
"""
from __future__ import annotations

from .selector import QuestConfig, QuestSelector

__all__ = ["QuestConfig", "QuestSelector"]
