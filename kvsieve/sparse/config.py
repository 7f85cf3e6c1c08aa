"""User configuration and its lowering to per-layer plans (``None`` = dense layer), resolved once."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .backends import AttentionBackend, get_backend
from .selector_base import ATTENTION_KINDS, PHASES, SparseSelector
from .knobs import KnobError, check_knobs, check_value
from .sparse_layers import sparse_layers
from .registry import create_selector

__all__ = ["SparseAttentionConfig", "LayerPlan", "lower_config"]


@dataclass(frozen=True)
class LayerPlan:
    """What one sparse layer runs: its selector and the phases it selects in."""

    selector: SparseSelector
    phases: frozenset[str]


@dataclass
class SparseAttentionConfig:
    """``selector`` name, its config fields, and which layers stay dense.

    ``dense_layers`` lists layer indices that run dense attention (negative indices count from
    the end); ``phases`` restricts where the selector runs (default: all it supports).
    ``layers`` (explicit indices) and ``layer_types`` (e.g. ``("full_attention",)``) choose the
    layers the selector runs on; by default only the full-attention layers of a model that
    interleaves layer types, else all (see :mod:`kvsieve.sparse.sparse_layers`). A list is taken for
    any of these tuples; a bare string is refused (it is not a tuple).
    """

    selector: str
    params: dict[str, Any] = field(default_factory=dict)
    dense_layers: tuple[int, ...] = ()
    phases: tuple[str, ...] | None = None
    layers: tuple[int, ...] | None = None
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("dense_layers", "phases", "layers", "layer_types"):
            if isinstance(getattr(self, name), list):
                setattr(self, name, tuple(getattr(self, name)))
        check_knobs(self, "SparseAttentionConfig")
        for phase in self.phases or ():
            if phase not in PHASES:
                raise KnobError(f"SparseAttentionConfig.phases entries must be in {list(PHASES)}, got {phase!r}")
        if self.phases is not None and not self.phases:
            raise KnobError(f"SparseAttentionConfig.phases must be None (all the selector supports) or a non-empty "
                            f"tuple of {list(PHASES)}, got ()")


def lower_config(config: SparseAttentionConfig | None, *, num_layers: int, attention_kind: str = "gqa",
                 device: str | torch.device = "cpu", layer_types: list[str] | None = None,
                 layer_windows: list[int | None] | None = None,
                 backend: AttentionBackend | str | None = None) -> list[LayerPlan | None]:
    """Resolve ``config`` into one plan per layer; raises at configuration time on anything unsupported.
    ``layer_types``: the model's type of each layer (``None``: every layer ``"full_attention"``);
    ``layer_windows``: each layer's sliding window (``None`` entries or list: none). A selector
    chosen for a windowed layer must declare ``Capabilities.sliding_window`` and not evict; the
    error names the selector, the layer and its type. ``backend`` (a name or an instance): refused
    when it cannot compute ``attention_kind`` on ``device`` or run what the selector asks of it
    (:meth:`AttentionBackend.refusal`)."""
    check_value("lower_config.num_layers", num_layers, int, ge=1)
    if layer_windows is not None and len(layer_windows) != num_layers:
        raise ValueError(f"lower_config: layer_windows has {len(layer_windows)} entries for {num_layers} layers")
    check_value("lower_config.attention_kind", attention_kind, str, choices=ATTENTION_KINDS)
    if config is None:
        return [None] * num_layers
    if not isinstance(config, SparseAttentionConfig):
        raise TypeError(f"lower_config expects a SparseAttentionConfig or None, got {type(config).__name__}")
    selector = create_selector(config.selector, **config.params)
    selector.check_support(attention_kind=attention_kind, device=device)
    if backend is not None:
        (get_backend(backend) if isinstance(backend, str) else backend).check(
            attention_kind=attention_kind, device=device, skip_softmax=selector.capabilities.skip_softmax)
    for phase in config.phases or ():
        selector.check_support(phase=phase)
    chosen = sparse_layers(num_layers=num_layers, model_layer_types=layer_types, layers=config.layers,
                           layer_types=config.layer_types, dense_layers=config.dense_layers)
    # sliding-window layers may stay dense beside evicting full-attention layers: they keep their
    # own cache group and length (kvsieve.sparse.Engine checks the groups)
    dense = {i for i in set(range(num_layers)) - chosen if layer_windows is None or layer_windows[i] is None}
    if dense and selector.capabilities.evicts:
        raise ValueError(
            f"selector {config.selector!r} evicts prompt tokens, which every layer of a cache group must do alike "
            f"(the group's length is shared); it must run on every full-attention layer, but layers {sorted(dense)} are dense "
            f"(dense_layers / layers / layer_types; the model's layer types: {sorted(set(layer_types or ['full_attention']))})"
        )
    for i in sorted(chosen):
        window = layer_windows[i] if layer_windows is not None else None
        if window is not None:
            kind = layer_types[i] if layer_types is not None else "windowed"
            try:
                selector.check_support(window=window)
            except ValueError as e:
                raise ValueError(f"layer {i} ({kind} layer): {e}") from None
    phases = frozenset(config.phases) if config.phases else selector.capabilities.phases
    plan = LayerPlan(selector, phases)
    return [plan if i in chosen else None for i in range(num_layers)]
