"""The selector base class: a name, a config dataclass, declared capabilities and two hooks.

A selector decides, per layer and step, which prompt tokens the cache keeps (``predict_kv``,
context phase) and which tokens or blocks each query attends (``predict_attn``). Either hook
may return ``None`` (nothing to do). Adding one is one file::

    @register_selector
    class MySelector(SparseSelector):
        name = "mine"
        config_class = MyConfig
        capabilities = Capabilities(phases={"generation"}, granularity="token")
        def predict_attn(self, inputs): ...
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from ..metadata import AttentionMetadata, KVCacheManager
from .params import SparseMetadataParams, SparseRuntimeParams

__all__ = ["Capabilities", "SelectorInputs", "SparseSelector", "PHASES", "ATTENTION_KINDS", "DEVICES"]

PHASES = ("context", "generation")
ATTENTION_KINDS = ("gqa", "mla")
DEVICES = ("cpu", "cuda")
GRANULARITIES = ("token", "block", "none")


@dataclass(frozen=True)
class Capabilities:
    """What a selector can serve. ``granularity``: ``token``/``block`` indices or ``none`` (hints)."""

    phases: frozenset[str] = frozenset(PHASES)
    attention_kinds: frozenset[str] = frozenset({"gqa"})
    granularity: str = "token"
    devices: frozenset[str] = frozenset(DEVICES)
    evicts: bool = False

    def __post_init__(self) -> None:
        for name, allowed in (("phases", PHASES), ("attention_kinds", ATTENTION_KINDS), ("devices", DEVICES)):
            values = frozenset(getattr(self, name))
            object.__setattr__(self, name, values)
            if not values or not values <= set(allowed):
                raise ValueError(f"Capabilities.{name} must be a non-empty subset of {list(allowed)}, got {sorted(values)}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"Capabilities.granularity must be one of {list(GRANULARITIES)}, got {self.granularity!r}")


@dataclass
class SelectorInputs:
    """Everything a hook may read for one layer and step.

    ``q [num_tokens, num_q_heads, head_dim]``; GQA ``k``/``v [num_tokens, num_kv_heads,
    head_dim]`` (the step's new tokens, already in the cache); MLA ``k`` is the latent
    ``[num_tokens, kv_lora_rank + rope_dim]`` and ``v`` is ``None``.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor | None
    metadata: AttentionMetadata
    layer_idx: int
    num_kv_heads: int
    sm_scale: float
    attention_kind: str = "gqa"
    _keys: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def cache(self) -> KVCacheManager:
        return self.metadata.kv_cache_manager

    @property
    def num_q_heads(self) -> int:
        return self.q.shape[1]

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def query_range(self, i: int) -> tuple[int, int]:
        """Token rows ``[start, end)`` of request ``i`` of the batch."""
        qs = self.metadata.query_start_host
        return int(qs[i]), int(qs[i + 1])

    def request_keys(self, i: int) -> torch.Tensor:
        """All valid keys of request ``i``: GQA ``[kv_len, num_kv_heads, head_dim]``; MLA latent ``[kv_len, R+P]``."""
        if i not in self._keys:
            rid = self.metadata.request_ids[i]
            self._keys[i] = self.cache.gather(self.layer_idx, rid)[0]
        return self._keys[i]

    def token_kv_lens_host(self) -> np.ndarray:
        """Host ``[num_tokens]``: positions each query token may attend (position + 1)."""
        return self.metadata.positions_host + 1


class SparseSelector:
    """Base class of every selector. Subclasses set the class attributes and override hooks."""

    name: ClassVar[str] = ""
    config_class: ClassVar[type] = object
    capabilities: ClassVar[Capabilities] = Capabilities()

    def __init__(self, config: Any = None, **overrides: Any) -> None:
        if config is None:
            config = self.config_class(**overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} expects a {self.config_class.__name__}, got {type(config).__name__}")
        self.config = config

    # ---- configuration-time checks ------------------------------------------------------
    def check_support(self, *, phase: str | None = None, attention_kind: str | None = None,
                      device: str | torch.device | None = None) -> None:
        """Raise ``ValueError`` listing what is supported when a combination is not."""
        cap = self.capabilities
        dev = None if device is None else torch.device(device).type
        for what, value, allowed in (
            ("phase", phase, cap.phases), ("attention kind", attention_kind, cap.attention_kinds),
            ("device", dev, cap.devices),
        ):
            if value is not None and value not in allowed:
                raise ValueError(
                    f"selector {self.name!r} does not support {what} {value!r}; supported: {sorted(allowed)}"
                )

    def metadata_params(self) -> SparseMetadataParams:
        """Sizing hints for buffers the metadata preallocates (override when known)."""
        return SparseMetadataParams()

    # ---- hooks --------------------------------------------------------------------------
    def on_append(self, inputs: SelectorInputs) -> None:
        """Called after the step's K/V are written, before any prediction (e.g. page summaries)."""

    def predict_kv(self, inputs: SelectorInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Context phase: ``(sparse_kv_indices [Hkv, total_kept], sparse_kv_offsets [num_contexts+1])`` or ``None``."""
        return None

    def predict_attn(self, inputs: SelectorInputs) -> SparseRuntimeParams | None:
        """Which tokens/blocks each query attends (or kernel hints), or ``None`` for dense."""
        return None

    def on_compacted(self, inputs: SelectorInputs, kept: list[torch.Tensor]) -> None:
        """Called after this layer's cache was compacted (``kept[i]``: ``[Hkv, n_keep]`` of context ``i``)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"
