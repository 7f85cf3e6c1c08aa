"""What a sweep runs: the plan of runs (cells of task x length, the dense run first, then each
selector at each budget), each run's identity (its fully resolved config) and id (the identity's
hash), and which runs can share the cell's dense prefill.

A run's selector shares the dense prefill when it acts in the generation phase only, evicts
nothing and either keeps no per-token state or rebuilds it from the cache when installed
(``on_attach``, e.g. Quest's page summaries): the session rewinds the paged cache to the prompt and
decodes again. Others (DSA's indexer keys, prompt eviction) prefill on their own.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from .. import __version__, create_selector
from ..sparse import SparseAttentionConfig, SparseSelector, attach_refusal
from .config import RESULT_NEUTRAL, TRANSFORMERS, VLLM, Budget, EvalConfig, SelectorSpec, TaskSpec
from .served.protocol import engine_identity, plugin_dense_budget
from .tasks import get_task

__all__ = ["DENSE", "RunSpec", "compute_run_id", "plan_runs", "run_identity", "shares_prefill"]

DENSE = "dense"


@dataclass
class RunSpec:
    """One run: a task at a length, a model, and a selector at a budget (``None`` = dense)."""

    task: TaskSpec
    length: int
    model: str
    selector: SelectorSpec | None = None
    budget: Budget | None = None
    sparse: SparseAttentionConfig | None = field(default=None, init=False)
    shares_prefill: bool = field(default=True, init=False)

    def __post_init__(self) -> None:
        if self.selector is not None:
            self.sparse = self.selector.sparse_config(self.budget)
            self.shares_prefill = shares_prefill(self.sparse)

    @property
    def label(self) -> str:
        return DENSE if self.selector is None else self.selector.label

    @property
    def folder(self) -> str:
        budget = "full" if self.budget is None else self.budget.label
        return f"{self.task.name}__{self.length}__{self.model}__{self.label}__{budget}"

    def describe(self) -> dict[str, Any]:
        """The columns that name the run (shared by metrics.json and summary.csv)."""
        b = self.budget
        return {"task": self.task.name, "length": self.length, "model": self.model, "selector": self.label,
                "budget_label": b.label if b else "full", "budget_tokens": b.tokens if b else self.length,
                "target_sparsity": b.sparsity if b else 0.0, "reduction_factor": b.reduction_factor if b else 1.0}


#: selector-entry fields renamed since runs were first recorded: the identity keeps the first names,
#: so earlier runs keep their ids
_FIRST_NAMES = {"calibrate": "prepare", "calibrate_params": "prepare_params"}


def run_identity(cfg: EvalConfig, run: RunSpec) -> dict[str, Any]:
    """The fully resolved config of ``run``: everything its results depend on. Every field of
    :class:`EvalConfig` outside ``RESULT_NEUTRAL`` is included, so a field added later counts too.
    The engine enters as what it fixes (:func:`~.served.protocol.engine_identity`), and not at all
    for ``transformers``, so runs made before the engine was a field keep their ids."""
    top = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in RESULT_NEUTRAL}
    if top.pop("engine") != TRANSFORMERS:
        top["engine"] = engine_identity()
    # a task without options or revisions keeps the id it had before tasks took them
    task = {k: v for k, v in asdict(run.task).items() if k != "lengths" and (k != "params" or v)}
    revision = get_task(run.task.name, run.task.params).revision
    if revision:
        task["revision"] = revision
    selector = None
    if run.selector is not None:
        axis = ("budgets", "sparsities", "reduction_factors")
        selector = {_FIRST_NAMES.get(k, k): v for k, v in asdict(run.selector).items() if k not in axis}
        selector["budget"] = asdict(run.budget)
    return {"kvsieve_version": __version__, **top, "model_name": run.model,
            "task": {**task, "length": run.length}, "selector": selector,
            "sparse_config": asdict(run.sparse) if run.sparse else None}


def compute_run_id(identity: dict[str, Any]) -> str:
    """The run's id: a hash of its identity (:func:`run_identity`)."""
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def shares_prefill(config: SparseAttentionConfig) -> bool:
    """True when the selector acts only while decoding, evicts nothing, and can be installed on a
    prompt already in the cache (:func:`~kvsieve.sparse.attach_refusal`): then a dense prefill is
    the prefill it would have run."""
    sel = create_selector(config.selector, **config.params)
    phases = set(config.phases or sel.capabilities.phases)
    no_kv = type(sel).predict_kv is SparseSelector.predict_kv
    return no_kv and not sel.capabilities.evicts and phases == {"generation"} and attach_refusal(sel) is None


def plan_runs(cfg: EvalConfig, model_name: str) -> list[list[RunSpec]]:
    """Runs grouped by cell (task, length); the dense run first in each cell. With the vLLM engine,
    each entry also has a run of dense attention through the plug-in (:mod:`.served.protocol`)."""
    cells = []
    for t in cfg.tasks:
        get_task(t.name, t.params)
        for length in t.lengths:
            runs = [RunSpec(t, length, model_name)]
            runs += [RunSpec(t, length, model_name, s, b) for s in cfg.selectors for b in s.resolve(length)]
            if cfg.engine == VLLM:
                runs += [RunSpec(t, length, model_name, s, plugin_dense_budget(length)) for s in cfg.selectors]
            cells.append(runs)
    return cells
