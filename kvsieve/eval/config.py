"""The sweep configuration: YAML file, then ``--set key=value`` overrides, then validation.

A selector entry maps a budget onto that selector's own config fields, so a new selector is one
entry::

    selectors:
      quest:                      # label used in run folders and plots
        selector: quest           # registry name (default: the label)
        budgets: [64, 256]        # tokens per query; or sparsities: [...] or compression_ratios: [...]
        budget_params: [budget]   # config fields that receive the token budget; a mapping
                                  # {topk_blocks: 16} passes budget // 16 (budgets in blocks)
        budget_multiple: 16       # round the budget down to a multiple (page-granular selectors)
        params: {page_size: 16}   # fixed config fields
        phases: [generation]      # where the selector acts (dense elsewhere)
        dense_layers: [0, 1]
        layer_types: [full_attention]  # or layers: [2, 3]; default: the full-attention layers of
                                       # an interleaved model (Gemma 3), else every layer

Budget conventions, all three logged per run: ``budget`` (tokens attended per query and KV head),
``sparsity = 1 - budget / L`` and ``compression_ratio = L / budget`` (the "400x" of RocketKV), with
``L`` the context length of the cell.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ..sparse import SparseAttentionConfig

__all__ = ["SelectorSpec", "TaskSpec", "EvalConfig", "Budget", "load_config", "apply_overrides", "QUICK", "DEFAULT"]

QUICK = "quick"
DEFAULT = "default"
_BUDGET_FORMS = ("budgets", "sparsities", "compression_ratios")


@dataclass(frozen=True)
class Budget:
    """One point of a selector's budget axis, resolved for a context length."""

    label: str
    tokens: int
    sparsity: float
    compression_ratio: float


@dataclass
class SelectorSpec:
    """How the sweep builds a :class:`SparseAttentionConfig` for each budget (see module docstring)."""

    label: str
    selector: str
    budgets: list[float] = field(default_factory=list)
    sparsities: list[float] = field(default_factory=list)
    compression_ratios: list[float] = field(default_factory=list)
    budget_params: list[str] | dict[str, int] = field(default_factory=lambda: ["budget"])
    budget_multiple: int = 1
    params: dict[str, Any] = field(default_factory=dict)
    phases: list[str] = field(default_factory=lambda: ["generation"])
    dense_layers: list[int] = field(default_factory=list)
    layers: list[int] | None = None
    layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        given = [f for f in _BUDGET_FORMS if getattr(self, f)]
        if len(given) != 1:
            raise ValueError(f"selectors.{self.label}: give exactly one of {list(_BUDGET_FORMS)}, got {given}")
        if self.budget_multiple < 1:
            raise ValueError(f"selectors.{self.label}.budget_multiple must be >= 1, got {self.budget_multiple}")
        for s in self.sparsities:
            if not 0 <= s < 1:
                raise ValueError(f"selectors.{self.label}.sparsities entries must be in [0, 1), got {s}")
        for r in self.compression_ratios:
            if r < 1:
                raise ValueError(f"selectors.{self.label}.compression_ratios entries must be >= 1, got {r}")
        if isinstance(self.budget_params, dict) and any(u < 1 for u in self.budget_params.values()):
            raise ValueError(f"selectors.{self.label}.budget_params units must be >= 1, got {self.budget_params}")
        for b in self.budgets:
            if b < 1:
                raise ValueError(f"selectors.{self.label}.budgets entries must be >= 1 token, got {b}")

    def resolve(self, length: int) -> list[Budget]:
        """The budget axis at context length ``length`` (tokens)."""
        out = []
        form = next(f for f in _BUDGET_FORMS if getattr(self, f))
        for x in getattr(self, form):
            if form == "budgets":
                tokens, label = int(x), f"b{int(x)}"
            elif form == "sparsities":
                tokens, label = math.ceil(length * (1 - x)), f"s{x:g}"
            else:
                tokens, label = math.ceil(length / x), f"cr{x:g}"
            m = self.budget_multiple
            tokens = max(m, tokens // m * m)
            out.append(Budget(label, tokens, max(0.0, 1 - tokens / length), length / tokens))
        return out

    def sparse_config(self, budget: Budget) -> SparseAttentionConfig:
        params = dict(self.params)
        units = self.budget_params if isinstance(self.budget_params, dict) else dict.fromkeys(self.budget_params, 1)
        params.update({p: budget.tokens // unit for p, unit in units.items()})
        return SparseAttentionConfig(self.selector, params, dense_layers=tuple(self.dense_layers),
                                     phases=tuple(self.phases) if self.phases else None,
                                     layers=None if self.layers is None else tuple(self.layers),
                                     layer_types=None if self.layer_types is None else tuple(self.layer_types))


@dataclass
class TaskSpec:
    """Which lengths (prompt tokens), needle depths (percent) and samples per cell a task runs."""

    name: str
    lengths: list[int]
    depths: list[float] = field(default_factory=lambda: [50.0])
    samples: int = 1

    def __post_init__(self) -> None:
        if not self.lengths or any(n < 64 for n in self.lengths):
            raise ValueError(f"tasks.{self.name}.lengths must be a non-empty list of lengths >= 64, got {self.lengths}")
        if self.samples < 1:
            raise ValueError(f"tasks.{self.name}.samples must be >= 1, got {self.samples}")


@dataclass
class EvalConfig:
    """The whole sweep. ``model``: ``smollm2``, ``tiny-random`` or a local checkpoint directory."""

    model: str = "smollm2"
    output_dir: str = "eval_results"
    backend: str = "torch"
    check: int = 0
    seed: int = 0
    threads: int = 0
    tasks: list[TaskSpec] = field(default_factory=list)
    selectors: list[SelectorSpec] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tasks"] = {t.pop("name"): t for t in d["tasks"]}
        d["selectors"] = {s.pop("label"): s for s in d["selectors"]}
        return d


def _builtin(name: str) -> dict[str, Any]:
    text = resources.files("kvsieve.eval").joinpath("configs", f"{name}.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``key.sub=value`` (value parsed as YAML) into a copy of ``raw``; ``key=null`` deletes."""
    out = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key.sub=value")
        path, value = item.split("=", 1)
        keys = path.split(".")
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {k!r} is not a mapping")
        parsed = yaml.safe_load(value)
        if parsed is None:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = parsed
    return out


def from_dict(raw: dict[str, Any]) -> EvalConfig:
    """Validate a raw mapping (as read from YAML) into an :class:`EvalConfig`."""
    raw = dict(raw)
    known = {f.name for f in dataclasses.fields(EvalConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown config keys {unknown}; known: {sorted(known)}")
    tasks = [TaskSpec(name=k, **(v or {})) for k, v in (raw.pop("tasks", None) or {}).items()]
    sels = []
    for label, v in (raw.pop("selectors", None) or {}).items():
        v = dict(v or {})
        sels.append(SelectorSpec(label=label, selector=v.pop("selector", label), **v))
    return EvalConfig(tasks=tasks, selectors=sels, **raw)


def load_config(path: str | Path | None = None, *, preset: str | None = None,
                overrides: list[str] | None = None) -> EvalConfig:
    """A YAML file, or a built-in preset (``quick``/``default``), then the overrides."""
    if path is not None and preset is not None:
        raise ValueError("give a config path or a preset, not both")
    raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) if path else _builtin(preset or DEFAULT)
    return from_dict(apply_overrides(raw or {}, overrides or []))
