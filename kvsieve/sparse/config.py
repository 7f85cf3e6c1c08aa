"""User configuration and its lowering to per-layer plans (``None`` = dense layer), resolved once."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .algorithm import SparseSelector
from .layer_plan import sparse_layers
from .params import SparseMetadataParams
from .registry import create_selector

__all__ = ["SparseAttentionConfig", "LayerPlan", "lower_config"]


@dataclass(frozen=True)
class LayerPlan:
    """What one sparse layer runs: its selector and the metadata sizing it asks for."""

    selector: SparseSelector
    metadata_params: SparseMetadataParams
    phases: frozenset[str]


@dataclass
class SparseAttentionConfig:
    """``selector`` name, its config fields, and which layers stay dense.

    ``dense_layers`` lists layer indices that run dense attention (negative indices count from
    the end); ``phases`` restricts where the selector runs (default: all it supports).
    ``layers`` (explicit indices) and ``layer_types`` (e.g. ``("full_attention",)``) choose the
    layers the selector runs on; by default only the full-attention layers of a model that
    interleaves layer types, else all (see :mod:`kvsieve.sparse.layer_plan`).
    """

    selector: str
    params: dict[str, Any] = field(default_factory=dict)
    dense_layers: tuple[int, ...] = ()
    phases: tuple[str, ...] | None = None
    layers: tuple[int, ...] | None = None
    layer_types: tuple[str, ...] | None = None


def lower_config(config: SparseAttentionConfig | None, *, num_layers: int, attention_kind: str = "gqa",
                 device: str | torch.device = "cpu", layer_types: list[str] | None = None) -> list[LayerPlan | None]:
    """Resolve ``config`` into one plan per layer; raises at configuration time on anything unsupported.
    ``layer_types``: the model's type of each layer (``None``: every layer ``"full_attention"``)."""
    if config is None:
        return [None] * num_layers
    selector = create_selector(config.selector, **config.params)
    selector.check_support(attention_kind=attention_kind, device=device)
    for phase in config.phases or ():
        selector.check_support(phase=phase)
    chosen = sparse_layers(num_layers=num_layers, model_layer_types=layer_types, layers=config.layers,
                           layer_types=config.layer_types, dense_layers=config.dense_layers)
    dense = set(range(num_layers)) - chosen
    if dense and selector.capabilities.evicts:
        raise ValueError(
            f"selector {config.selector!r} evicts prompt tokens, which every layer must do alike "
            f"(the ledger length is shared); it must run on every layer, but layers {sorted(dense)} are dense "
            f"(dense_layers / layers / layer_types; the model's layer types: {sorted(set(layer_types or ['full_attention']))})"
        )
    phases = frozenset(config.phases) if config.phases else selector.capabilities.phases
    plan = LayerPlan(selector, selector.metadata_params(), phases)
    return [plan if i in chosen else None for i in range(num_layers)]
