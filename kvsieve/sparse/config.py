"""User configuration and its lowering to per-layer plans (``None`` = dense layer), resolved once."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .algorithm import SparseSelector
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
    """

    selector: str
    params: dict[str, Any] = field(default_factory=dict)
    dense_layers: tuple[int, ...] = ()
    phases: tuple[str, ...] | None = None


def lower_config(config: SparseAttentionConfig | None, *, num_layers: int, attention_kind: str = "gqa",
                 device: str | torch.device = "cpu") -> list[LayerPlan | None]:
    """Resolve ``config`` into one plan per layer; raises at configuration time on anything unsupported."""
    if config is None:
        return [None] * num_layers
    selector = create_selector(config.selector, **config.params)
    selector.check_support(attention_kind=attention_kind, device=device)
    for phase in config.phases or ():
        selector.check_support(phase=phase)
    dense = set()
    for i in config.dense_layers:
        if not -num_layers <= i < num_layers:
            raise ValueError(f"dense_layers entry {i} is outside [-{num_layers}, {num_layers})")
        dense.add(i % num_layers)
    if dense and selector.capabilities.evicts:
        raise ValueError(
            f"selector {config.selector!r} evicts prompt tokens, which every layer must do alike "
            f"(the ledger length is shared); dense_layers must be empty, got {sorted(dense)}"
        )
    phases = frozenset(config.phases) if config.phases else selector.capabilities.phases
    plan = LayerPlan(selector, phases)
    return [None if i in dense else plan for i in range(num_layers)]
