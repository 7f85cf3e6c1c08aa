"""The sweep: tasks x lengths x (dense + selectors x budgets), one folder per run, resumable.

A cell is (task, length). Its samples are generated once; for each sample the pending runs of the
cell execute back to back, those that can sharing one dense prefill (:mod:`.run_plan` plans the
runs and says which share).

Every run has an identity: its fully resolved config (model, backend, seed, task parameters at its
length, selector entry and budget, the lowered :class:`SparseAttentionConfig`, the kvsieve
version and every other result-relevant field of :class:`EvalConfig`); ``run_id`` is its hash. A
resume reuses a folder only when its ``metrics.json`` carries the same ``run_id`` and its files are
consistent (see :mod:`kvsieve.eval.store`); it reruns, and says why, every other run. Finished
samples of an unfinished run are kept in ``partial.json`` and not recomputed. A run that raises
writes ``error.txt`` and is marked ``failed`` in ``summary.csv``; the sweep goes on unless
``fail_fast``.

With ``engine: vllm`` the pending runs go through vLLM engines instead of kvsieve's session
(:mod:`.served`); planning, resume and the output files are the same.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from ..integrations.transformers import KvsieveSession
from ..selectors.dsa.projections import IndexerInputs
from ..sparse import get_selector_class
from .config import VLLM, ConfigError, EvalConfig
from .memory import reset_peak_rss
from ..integrations.transformers import attach_dsa_indexer
from .model import LoadedModel, checkpoint_folder, load_model
from .calibration import calibrate_selectors
from .plots import write_plots
from .report import format_table, write_report
from .run_plan import RunSpec, compute_run_id, plan_runs, run_identity
from .store import (CONFIG, PARTIAL, RunState, atomic_write_text, clear_run, discard_leftovers, read_state,
                    write_csv)
from .run_files import Progress, prediction_row, record_failure, write_run
from .served.agreement import AGREEMENT_CSV, compare_outputs, format_agreement, write_agreement
from .served.launch import vllm_python as find_vllm_python
from .served.protocol import SERVED_FIELDS, check_served
from .served.sweep import ServedSweep, run_served
from .tasks import Sample, Task, get_task

__all__ = ["SweepResult", "SweepInterrupted", "run_sweep", "SUMMARY_FIELDS"]

SUMMARY_FIELDS = ("task", "length", "model", "selector", "budget_label", "budget_tokens", "target_sparsity",
                  "reduction_factor", "achieved_sparsity", "score", "ci95_low", "ci95_high", "n", "partial",
                  "mass_recall", "rel_error", "topk_overlap", "kl", "accepted_length_k2", "accepted_length_k4",
                  "accepted_length_k8", "status", "error", "run_id", "folder")
_OPTIONAL_METRICS = ("partial", "mass_recall", "rel_error", "topk_overlap", "kl")


@dataclass
class SweepResult:
    """What a finished sweep wrote: absolute paths, the summary rows and the counts of the resume."""

    out: Path
    summary: Path
    report: Path
    plots: list[Path]
    rows: list[dict[str, Any]]
    counts: dict[str, int]

    @property
    def failed(self) -> int:
        return sum(r["status"] == "failed" for r in self.rows)


class SweepInterrupted(Exception):
    """Raised by :func:`run_sweep` on Ctrl-C, after saving; says what was saved."""

    def __init__(self, out: Path, done: int, total: int, partial_samples: int) -> None:
        self.out, self.done, self.total, self.partial_samples = out, done, total, partial_samples
        super().__init__(f"interrupted; saved {done} of {total} runs and {partial_samples} finished samples of "
                         f"unfinished runs under {out}")


@dataclass
class _Sweep:
    cfg: EvalConfig
    lm: LoadedModel
    out: Path
    session: KvsieveSession
    bar: Any
    fail_fast: bool
    log: Callable[[str], None]


def run_sweep(cfg: EvalConfig, *, loaded: LoadedModel | None = None, progress: bool = True, fail_fast: bool = False,
              log: Callable[[str], None] = print, vllm_python: str | None = None,
              agree_with: str | Path | None = None) -> SweepResult:
    """Run every run of ``cfg`` not already done; write summary.csv, plots and report.md.
    ``cfg.engine == "vllm"``: the runs go through vLLM (:mod:`.served`), whose engines run on
    ``vllm_python`` (:func:`.served.launch.vllm_python` finds one when ``None``). ``agree_with``:
    another output folder whose runs are compared with this sweep's prompt by prompt
    (:func:`.served.agreement.compare_outputs`; printed, ``agreement.csv``, a section of the report).

    Raises :class:`SweepInterrupted` on Ctrl-C (after writing summary.csv of what is done)."""
    if agree_with is not None and not Path(agree_with).is_dir():
        raise ConfigError(f"--agree-with {agree_with}: no such output folder")
    served = cfg.engine == VLLM
    if served:  # refused before the model is loaded
        check_served(cfg, calibrated=False)
        vllm_python = find_vllm_python(vllm_python)
        try:
            checkpoint_folder(cfg.model)
        except ValueError as err:
            raise ConfigError(f"model (--engine vllm loads its checkpoint folder): {err}") from None
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    lm = loaded if loaded is not None else load_model(cfg.model)
    cfg = calibrate_selectors(cfg, lm, log)
    if served:
        check_served(cfg, calibrated=True)
    fields = SUMMARY_FIELDS + (SERVED_FIELDS if served else ())
    cells = plan_runs(cfg, lm.name)
    runs = [r for cell in cells for r in cell]
    ids = {r.folder: compute_run_id(run_identity(cfg, r)) for r in runs}
    states = {r.folder: read_state(out / r.folder, ids[r.folder], run_identity(cfg, r)) for r in runs}
    counts = Counter(s.status for s in states.values())
    for r in runs:  # a kill between a run's metrics.json and this cleanup leaves them behind
        if states[r.folder].status == "done":
            discard_leftovers(out / r.folder)
    _log_plan(log, out, lm.name, runs, states, counts)
    pending = [[r for r in cell if states[r.folder].status != "done"] for cell in cells]
    total = sum(_num_samples(r) - len(states[r.folder].partial.get("rows", [])) for p in pending for r in p)
    try:
        if total and served:
            bar = _progress(total, progress)
            try:
                run_served(ServedSweep(cfg, lm, out, vllm_python, bar, log, fail_fast, ids), runs,
                           [r for p in pending for r in p])
            finally:
                bar.close()
        elif total:
            max_len = max(r.length for r in runs)
            cpu = next(lm.model.parameters()).device.type == "cpu"
            session = KvsieveSession(lm.model, None, backend=cfg.backend, max_tokens=max_len + 256, release_windows=False,
                                     decode_threads=1 if cpu else None, check_steps=cfg.check)
            bar = _progress(total, progress)
            sweep = _Sweep(cfg, lm, out, session, bar, fail_fast, log)
            try:
                for cell, todo in zip(cells, pending):
                    if todo:
                        _run_cell(sweep, cell, todo, states, ids)
            finally:
                bar.close()
            if session.golden_check is not None:
                gc = session.golden_check
                log(f"kvsieve eval: golden check: {gc.steps_checked} steps vs vanilla, max |diff| {gc.max_diff:.3g}")
        # an interrupt while the summary, plots or report are written still reports what was saved
        rows = _summary_rows(out, runs, ids, fields)
        write_csv(out / "summary.csv", rows, fields)
        ok = [r for r in rows if r["status"] == "ok"]
        plots = write_plots(out, ok)
        agreement = None
        if agree_with is not None:
            try:
                agreement = compare_outputs(Path(agree_with), out)
            except ValueError as err:
                raise ConfigError(f"--agree-with {agree_with}: {err}") from None
            write_agreement(out / AGREEMENT_CSV, agreement)
            log(f"kvsieve eval: {Path(agree_with).resolve()} vs {out}, " + format_agreement(agreement))
        report = write_report(out, cfg, rows, plots, agreement, agree_with)
    except KeyboardInterrupt:
        rows = _summary_rows(out, runs, ids, fields)
        write_csv(out / "summary.csv", rows, fields)
        partial = sum(len(read_state(out / r.folder, ids[r.folder], {}).partial.get("rows", [])) for r in runs)
        raise SweepInterrupted(out, sum(r["status"] == "ok" for r in rows), len(runs), partial) from None
    log(format_table(rows))
    failed = len(rows) - len(ok)
    log(f"kvsieve eval: done in {time.perf_counter() - t_start:.0f} s; {len(ok)} runs ok"
        + (f", {failed} failed (their error.txt says why; rerun to retry them)" if failed else ""))
    log(f"  summary: {out / 'summary.csv'}\n  report:  {report}")
    for p in plots:
        log(f"  plot:    {p}")
    return SweepResult(out, out / "summary.csv", report, plots, rows, dict(counts))


def _log_plan(log: Callable[[str], None], out: Path, model: str, runs: list[RunSpec], states: dict[str, RunState],
              counts: Counter) -> None:
    rerun = counts["changed"] + counts["corrupt"] + counts["failed"]
    log(f"kvsieve eval: {len(runs)} runs, model {model}, output {out}: {counts['done']} reused, {counts['new']} new, "
        f"{rerun} rerun, {counts['partial']} resumed")
    shown = [r for r in runs if states[r.folder].status in ("changed", "corrupt", "failed", "partial")]
    for r in shown[:10]:
        log(f"  {r.folder}: {states[r.folder].reason}")
    if len(shown) > 10:
        log(f"  ... and {len(shown) - 10} more")


def _num_samples(run: RunSpec) -> int:
    task = get_task(run.task.name)
    return run.task.samples * (len(run.task.depths) if task.uses_depths else 1)


def _progress(total: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="run-sample", disable=not enabled, dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}] {postfix}")


def _run_cell(sw: _Sweep, cell: list[RunSpec], todo: list[RunSpec], states: dict[str, RunState],
              ids: dict[str, str]) -> None:
    spec, length = cell[0].task, cell[0].length
    task = get_task(spec.name, spec.params)
    prog: dict[str, Progress] = {}
    for run in todo:
        folder, state = sw.out / run.folder, states[run.folder]
        if state.status == "partial":
            p = state.partial
            prog[run.folder] = Progress(p["rows"], p["fractions"], float(p.get("seconds", 0.0)))
            continue
        clear_run(folder)
        folder.mkdir(parents=True, exist_ok=True)
        identity = run_identity(sw.cfg, run)
        atomic_write_text(folder / CONFIG, yaml.safe_dump({"run_id": ids[run.folder], "identity": identity},
                                                          sort_keys=False))
        prog[run.folder] = Progress()
    try:
        samples = task.make_samples(sw.lm.tokenizer, length, spec.depths, spec.samples, sw.cfg.seed)
    except Exception as err:  # the cell's prompts cannot be made: every run of it fails, the sweep goes on
        for run in todo:
            record_failure(sw.out / run.folder, ids[run.folder], err, sw.log)
        if sw.fail_fast:
            raise
        return
    dense = cell[0]
    reset_peak_rss()  # each finished run reports the process's peak since its cell began
    for i, sample in enumerate(samples):
        active = [r for r in todo if not prog[r.folder].failed and len(prog[r.folder].rows) == i]
        if not active:
            continue
        execute = list(active)
        # the dense run is the reference of the task (fidelity's KL, a continuation's tokens): it runs
        # again (unrecorded) when done
        if task.needs_reference and dense not in execute:
            execute.insert(0, dense)
        execute.sort(key=lambda r: (r.selector is not None, not r.shares_prefill))
        # the tokenizer's own special tokens (Gemma needs its <bos>)
        ids_t = torch.tensor([sw.lm.tokenizer.encode(sample.prompt, add_special_tokens=True)], dtype=torch.long)
        prefix = task.prefix_len(ids_t.shape[1])
        shared: list[torch.Tensor] = []
        reference = None
        for run in execute:
            sw.bar.set_postfix_str(f"{task.name} L={length} {run.label} {run.budget.label if run.budget else ''}")
            t0 = time.perf_counter()
            try:
                if task.needs_reference and run.selector is not None and reference is None:
                    raise RuntimeError(f"the dense reference run failed on this sample, so {task.name} cannot "
                                       "score it")
                row, frac = _execute(sw.session, task, run, ids_t, prefix, sample, reference,
                                     shared if sw.cfg.share_prefill else None, sw.lm.tokenizer)
            except Exception as err:  # recorded in the run's folder, the sweep goes on
                shared.clear()  # the session's state is unknown: the next run prefills anew
                if run in todo:
                    record_failure(sw.out / run.folder, ids[run.folder], err, sw.log)
                    prog[run.folder].failed = True
                if sw.fail_fast:
                    raise
                continue
            if run.selector is None:
                reference = row.get("_reference")
            if run not in todo or prog[run.folder].failed:
                continue
            p = prog[run.folder]
            p.seconds += time.perf_counter() - t0
            p.fractions.append(frac)
            p.rows.append(prediction_row(sample, ids_t.shape[1], row, frac))
            sw.bar.update(1)
            if len(p.rows) == len(samples):
                write_run(sw.out / run.folder, run, sw.cfg, ids[run.folder], p)
            else:
                atomic_write_text(sw.out / run.folder / PARTIAL, json.dumps(
                    {"run_id": ids[run.folder], "rows": p.rows, "fractions": p.fractions, "seconds": p.seconds}))


def _execute(session: KvsieveSession, task: Task, run: RunSpec, ids: torch.Tensor, prefix: int, sample: Sample,
             reference: Any, shared: list[torch.Tensor] | None,
             tokenizer: Any) -> tuple[dict[str, Any], list[float | None]]:
    """One run on one sample; ``shared`` holds the dense prefill's logits once a sharing run made it
    (``None``: sharing is off, every run prefills).
    A run whose selector reads :class:`IndexerInputs` (``dsa``) feeds it each layer's hidden state
    (hooks attached for the run only)."""
    reads_indexer = run.sparse is not None and get_selector_class(run.sparse.selector).model_inputs_type is IndexerInputs
    handles = attach_dsa_indexer(session) if reads_indexer else []
    try:
        if run.shares_prefill and shared is not None:
            if not shared:
                session.set_config(None)
                shared.append(session.prefill(ids[:, :prefix]))
            else:
                session.rewind(prefix)
            session.set_config(run.sparse)
            logits = shared[0]
        else:
            if shared is not None:
                shared.clear()  # this prefill replaces the cached prompt
            session.set_config(run.sparse)
            logits = session.prefill(ids[:, :prefix])
        session.reset_stats()
        row = task.run(session, logits, ids, sample, reference, tokenizer)
        return row, session.attended_fraction("generation")
    finally:
        for h in handles:
            h.remove()


def _summary_rows(out: Path, runs: list[RunSpec], ids: dict[str, str],
                  fields: tuple[str, ...]) -> list[dict[str, Any]]:
    """One row per run that is done (``status`` ok) or failed, in plan order."""
    rows = []
    for run in runs:
        state = read_state(out / run.folder, ids[run.folder], {})
        if state.status == "done":
            m = state.metrics
            row = {k: m.get(k) for k in fields}
            row["ci95_low"], row["ci95_high"] = m["ci95"]
            row.update(status="ok", error="")
        elif state.status == "failed":
            row = {**run.describe(), "status": "failed", "error": state.error}
        else:
            continue
        row.update(run_id=ids[run.folder], folder=run.folder)
        rows.append(row)
    return rows
