"""User configuration and its lowering to per-layer plans (``None`` = dense layer), resolved once."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .algorithm import ATTENTION_KINDS, PHASES, SparseSelector
from .knobs import KnobError, check_knobs, check_value
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
    the end); ``phases`` restricts where the selector runs (default: all it supports). A list is
    taken for either tuple; a bare string is refused (it is not a tuple of phases).
    """

    selector: str
    params: dict[str, Any] = field(default_factory=dict)
    dense_layers: tuple[int, ...] = ()
    phases: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("dense_layers", "phases"):
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
                 device: str | torch.device = "cpu") -> list[LayerPlan | None]:
    """Resolve ``config`` into one plan per layer; raises at configuration time on anything unsupported."""
    check_value("lower_config.num_layers", num_layers, int, ge=1)
    check_value("lower_config.attention_kind", attention_kind, str, choices=ATTENTION_KINDS)
    if config is None:
        return [None] * num_layers
    if not isinstance(config, SparseAttentionConfig):
        raise TypeError(f"lower_config expects a SparseAttentionConfig or None, got {type(config).__name__}")
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
