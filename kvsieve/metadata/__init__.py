"""The KV ledger (paged pools, allocator, block ledger) and what ``prepare()`` translates it into."""
from __future__ import annotations

from .attention_metadata import PHASES, TRANSLATIONS, AttentionMetadata
from .block_lists import BlockLists, build_block_lists
from .block_offsets import BlockOffsetTable, beam_rows, half_block_views
from .kv_cache import BlockAllocator, KVCacheManager, KVCacheSpec
from .ragged_page_table import RaggedPageTable

__all__ = [
    "AttentionMetadata", "PHASES", "TRANSLATIONS", "half_block_views", "BlockLists", "build_block_lists", "BlockOffsetTable", "beam_rows", "BlockAllocator",
    "KVCacheManager", "KVCacheSpec", "RaggedPageTable",
]
