"""kvsieve: sparse-attention plug-ins for paged-KV LLM inference.

Selectors write ``SparseRuntimeParams``; backends (``vanilla`` golden, ``triton``) consume them
on a paged GQA/MLA cache. Importing ``kvsieve`` registers the built-in selectors.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from . import selectors as _builtin_selectors  # noqa: F401  (registers the built-ins)
from .selectors import DSAConfig, DSASelector, IndexerInputs
from .metadata import AttentionMetadata, KVCacheManager, KVCacheSpec
from .sparse import (
    BudgetKnob, Capabilities, Engine, SelectorInputs, SparseAttention, SparseAttentionConfig,
    SparseRuntimeParams, SparseSelector, available_backends, available_selectors, create_selector, get_backend,
    lower_config, register_backend, register_selector,
)

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .integrations.transformers import KvsieveSession


def apply(model: torch.nn.Module, selector: str | None = None, **kwargs: Any) -> KvsieveSession:
    """``with kvsieve.apply(model, "quest", budget=256): model.generate(...)`` — see
    :func:`kvsieve.integrations.transformers.apply` (imported on the first call: the bridge loads
    only when used)."""
    from .integrations.transformers import apply as _apply

    return _apply(model, selector, **kwargs)

__all__ = [
    "apply", "DSAConfig", "DSASelector", "IndexerInputs",
    "AttentionMetadata", "KVCacheManager", "KVCacheSpec", "BudgetKnob", "Capabilities", "Engine", "SelectorInputs",
    "SparseAttention", "SparseAttentionConfig", "SparseRuntimeParams", "SparseSelector",
    "available_backends", "available_selectors", "create_selector", "get_backend", "lower_config",
    "register_backend", "register_selector",
]
