"""KV helpers: physical-slot translation, effective cost, in-place compaction."""
from __future__ import annotations

from .indexing import effective_attended_tokens, to_physical_slots
from .kernel import compact_kv_, compact_mla_kv_

__all__ = ["compact_kv_", "compact_mla_kv_", "effective_attended_tokens", "to_physical_slots"]
