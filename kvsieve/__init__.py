"""kvsieve: sparse-attention plug-ins for paged-KV LLM inference.

Selectors write ``SparseRuntimeParams``; backends (``vanilla`` golden, ``triton``) consume them
on a paged GQA/MLA cache. Importing ``kvsieve`` registers the built-in selectors.
"""
from __future__ import annotations

from . import selectors as _builtin_selectors  # noqa: F401  (registers the built-ins)
from .selectors import DSAConfig, DSASelector, IndexerInputs
from .metadata import AttentionMetadata, KVCacheManager, KVCacheSpec
from .sparse import (
    Capabilities, Engine, SelectorInputs, SparseAttention, SparseAttentionConfig,
    SparseRuntimeParams, SparseSelector, available_backends, available_selectors, create_selector, get_backend,
    lower_config, register_backend, register_selector,
)

__version__ = "0.1.0"
__all__ = [
    "DSAConfig", "DSASelector", "IndexerInputs",
    "AttentionMetadata", "KVCacheManager", "KVCacheSpec", "Capabilities", "Engine", "SelectorInputs",
    "SparseAttention", "SparseAttentionConfig", "SparseRuntimeParams", "SparseSelector",
    "available_backends", "available_selectors", "create_selector", "get_backend", "lower_config",
    "register_backend", "register_selector",
]
