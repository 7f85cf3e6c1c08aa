"""The sweep: tasks x lengths x (dense + selectors x budgets), one folder per run, resumable.

A cell is (task, length). Its samples are generated once; for each sample the runs of the cell
execute back to back. Runs whose selector keeps no prompt state (no ``on_append`` /
``predict_kv`` / ``on_compacted`` hook, acts in the generation phase only) share one dense
prefill: the session rewinds the paged cache to the prompt and decodes again. Others prefill on
their own. A run folder holding ``predictions.csv``, ``metrics.json`` and ``config.yaml`` is done
and skipped, so an interrupted sweep resumes.
"""
from __future__ import annotations

import csv
import json
import math
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from .. import __version__, available_selectors, create_selector
from ..integrations.transformers import KvsieveSession
from ..sparse import SparseAttentionConfig, SparseSelector
from .config import Budget, EvalConfig, SelectorSpec, TaskSpec
from .metrics import mean_ci95
from .model import LoadedModel, load_model
from .plots import write_plots
from .tasks import Sample, get_task

__all__ = ["RunSpec", "plan_runs", "run_sweep", "is_done", "DENSE", "RUN_FILES", "SUMMARY_FIELDS"]

DENSE = "dense"
RUN_FILES = ("predictions.csv", "metrics.json", "config.yaml")
SUMMARY_FIELDS = ("task", "length", "model", "selector", "budget_label", "budget_tokens", "target_sparsity",
                  "compression_ratio", "achieved_sparsity", "score", "ci95_low", "ci95_high", "n", "partial",
                  "mass_recall", "rel_error", "topk_overlap", "kl", "wall_time_s", "folder")
_STATELESS_HOOKS = ("on_append", "predict_kv", "on_compacted")


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
            self.shares_prefill = _shares_prefill(self.sparse)

    @property
    def label(self) -> str:
        return DENSE if self.selector is None else self.selector.label

    @property
    def folder(self) -> str:
        budget = "full" if self.budget is None else self.budget.label
        return f"{self.task.name}__{self.length}__{self.model}__{self.label}__{budget}"


def _shares_prefill(config: SparseAttentionConfig) -> bool:
    """True when the selector keeps no prompt state and acts only while decoding."""
    sel = create_selector(config.selector, **config.params)
    phases = set(config.phases or sel.capabilities.phases)
    hooks_free = all(getattr(type(sel), h) is getattr(SparseSelector, h) for h in _STATELESS_HOOKS)
    return hooks_free and not sel.capabilities.evicts and phases == {"generation"}


def is_done(folder: Path) -> bool:
    return all((folder / f).is_file() for f in RUN_FILES)


def plan_runs(cfg: EvalConfig, model_name: str, log: Callable[[str], None] = print) -> list[list[RunSpec]]:
    """Runs grouped by cell (task, length); the dense run first in each cell. Selectors that are
    not registered are skipped with a message."""
    known = set(available_selectors())
    specs = []
    for s in cfg.selectors:
        if s.selector in known:
            specs.append(s)
        else:
            log(f"kvsieve eval: selector {s.selector!r} ({s.label}) is not registered; skipped. "
                f"Registered: {sorted(known)}")
    cells = []
    for t in cfg.tasks:
        get_task(t.name)
        for length in t.lengths:
            runs = [RunSpec(t, length, model_name)]
            runs += [RunSpec(t, length, model_name, s, b) for s in specs for b in s.resolve(length)]
            cells.append(runs)
    return cells


def run_sweep(cfg: EvalConfig, *, loaded: LoadedModel | None = None, progress: bool = True,
              log: Callable[[str], None] = print) -> Path:
    """Run every pending run of ``cfg``; write summary.csv and plots; return the output folder."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    lm = loaded if loaded is not None else load_model(cfg.model)
    cells = plan_runs(cfg, lm.name, log)
    pending = [[r for r in cell if not is_done(out / r.folder)] for cell in cells]
    total = sum(len(p) * _num_samples(cell[0]) for p, cell in zip(pending, cells) if p)
    done_before = sum(len(c) for c in cells) - sum(len(p) for p in pending)
    log(f"kvsieve eval: {sum(len(c) for c in cells)} runs, {done_before} already done; model {lm.name}; "
        f"output {out}")
    if total:
        max_len = max(r.length for cell in cells for r in cell)
        cpu = next(lm.model.parameters()).device.type == "cpu"
        session = KvsieveSession(lm.model, None, backend=cfg.backend, max_tokens=max_len + 256,
                                 decode_threads=1 if cpu else None, check_steps=cfg.check)
        bar = _progress(total, progress)
        for cell, todo in zip(cells, pending):
            if todo:
                _run_cell(session, lm, cfg, cell, todo, out, bar)
        bar.close()
    rows = [_summary_row(out / r.folder) for cell in cells for r in cell if is_done(out / r.folder)]
    _write_csv(out / "summary.csv", rows, SUMMARY_FIELDS)
    write_plots(out, rows)
    if total and session.golden_check is not None:
        gc = session.golden_check
        log(f"kvsieve eval: golden check: {gc.steps_checked} steps vs vanilla, max |diff| {gc.max_diff:.3g}")
    log(f"kvsieve eval: done in {time.perf_counter() - t_start:.0f} s; {out / 'summary.csv'}")
    return out


def _num_samples(run: RunSpec) -> int:
    task = get_task(run.task.name)
    return run.task.samples * (len(run.task.depths) if task.uses_depths else 1)


def _progress(total: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="run-sample", disable=not enabled, dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}] {postfix}")


def _run_cell(session: KvsieveSession, lm: LoadedModel, cfg: EvalConfig, cell: list[RunSpec],
              todo: list[RunSpec], out: Path, bar: Any) -> None:
    task = get_task(cell[0].task.name)
    spec, length = cell[0].task, cell[0].length
    samples = task.make_samples(lm.tokenizer, length, spec.depths, spec.samples, cfg.seed)
    # the dense run always executes when a fidelity cell has work: it is the KL reference
    execute = [r for r in cell if r in todo or (r.selector is None and task.kind == "fidelity")]
    execute.sort(key=lambda r: (r.selector is not None, not r.shares_prefill))
    rows: dict[str, list[dict[str, Any]]] = {r.folder: [] for r in execute}
    fractions: dict[str, list[list[float | None]]] = {r.folder: [] for r in execute}
    seconds = dict.fromkeys(rows, 0.0)
    for sample in samples:
        # the tokenizer's own special tokens (Gemma needs its <bos>)
        ids = torch.tensor([lm.tokenizer.encode(sample.prompt, add_special_tokens=True)], dtype=torch.long)
        prefix = task.prefix_len(ids.shape[1])
        shared_logits, reference = None, None
        for run in execute:
            bar.set_postfix_str(f"{task.name} L={length} {run.label} {run.budget.label if run.budget else ''}")
            t0 = time.perf_counter()
            if run.shares_prefill:
                if shared_logits is None:
                    session.set_config(None)
                    shared_logits = session.prefill(ids[:, :prefix])
                else:
                    session.rewind(prefix)
                session.set_config(run.sparse)
                logits = shared_logits
            else:
                session.set_config(run.sparse)
                logits = session.prefill(ids[:, :prefix])
            session.reset_stats()
            row = task.run(session, logits, ids, sample, reference, lm.tokenizer)
            if run.selector is None:
                reference = row.get("_reference")
            seconds[run.folder] += time.perf_counter() - t0
            frac = session.attended_fraction("generation")
            fractions[run.folder].append(frac)
            rows[run.folder].append(_prediction_row(sample, ids.shape[1], row, frac))
            if run in todo:
                bar.update(1)
    for run in todo:
        _write_run(out / run.folder, run, cfg, rows[run.folder], fractions[run.folder], seconds[run.folder])


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _prediction_row(sample: Sample, num_tokens: int, row: dict[str, Any], frac: list[float | None]) -> dict[str, Any]:
    seen = [f for f in frac if f is not None]
    base = {"sample": sample.index, "depth": sample.depth, "prompt_tokens": num_tokens,
            "answers": "|".join(sample.answers), "attended_fraction": _mean(seen)}
    base.update({k: v for k, v in row.items() if not k.startswith("_")})
    return base


def _write_run(folder: Path, run: RunSpec, cfg: EvalConfig, rows: list[dict[str, Any]],
               fractions: list[list[float | None]], seconds: float) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    per_layer = []
    for layer in zip(*fractions):
        vals = [v for v in layer if v is not None]
        per_layer.append(_mean(vals) if vals else None)
    seen = [v for v in per_layer if v is not None]
    score, lo, hi = mean_ci95([float(r["score"]) for r in rows])
    b = run.budget
    metrics: dict[str, Any] = {
        "task": run.task.name, "length": run.length, "model": run.model, "selector": run.label,
        "selector_name": run.sparse.selector if run.sparse else DENSE,
        "budget_label": b.label if b else "full", "budget_tokens": b.tokens if b else run.length,
        "target_sparsity": b.sparsity if b else 0.0, "compression_ratio": b.compression_ratio if b else 1.0,
        "score": score, "ci95": [lo, hi], "n": len(rows),
        "achieved_sparsity": 1 - _mean(seen) if seen else 0.0, "attended_fraction_per_layer": per_layer,
        "wall_time_s": seconds, "shares_prefill": run.shares_prefill, "backend": cfg.backend,
        "kvsieve_version": __version__, "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    for key in ("partial", "mass_recall", "rel_error", "topk_overlap", "kl"):
        if rows and key in rows[0]:
            metrics[key] = _mean([float(r[key]) for r in rows])
    config = {"model": cfg.model, "backend": cfg.backend, "seed": cfg.seed,
              "task": asdict(run.task), "length": run.length,
              "selector": asdict(run.selector) if run.selector else None,
              "sparse_config": asdict(run.sparse) if run.sparse else None}
    _write_csv(folder / "predictions.csv", rows, list(rows[0]) if rows else ["sample"])
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    # metrics.json last: its presence (with the others) marks the run done
    (folder / "metrics.json").write_text(json.dumps(metrics, indent=2), encoding="utf-8")


def _write_csv(path: Path, rows: list[dict[str, Any]], fields: list[str] | tuple[str, ...]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(fields), extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def _summary_row(folder: Path) -> dict[str, Any]:
    m = json.loads((folder / "metrics.json").read_text(encoding="utf-8"))
    row = {k: m.get(k) for k in SUMMARY_FIELDS}
    row["ci95_low"], row["ci95_high"] = m["ci95"]
    row["folder"] = folder.name
    return row

