"""The vLLM path's execution of a sweep's pending runs (``kvsieve eval --engine vllm``).

:func:`kvsieve.eval.runner.run_sweep` plans the runs, reads what a resume finds and writes the
summary, plots and report, whichever engine ran them; this module runs the pending ones in vLLM
engines (:mod:`.engine`, what runs where: :mod:`.protocol`). The prompts are the eval's own (the
same samples, token ids encoded by the eval's tokenizer), greedy, and the answer is cut by the eval's
stop rule (:func:`.agreement.answer_tokens`). An engine answers a cell's runs prompt-major (each wave
of prompts in every run's setting back to back, :func:`_generate_cell`), so settings that keep a
dense prompt cache share one prefill per prompt. A run is done or failed as a whole (no partial samples).

**Decode speed-up.** For each run, at its length: :data:`~.protocol.TIMING_REPS` times, vLLM's own
attention decodes :data:`~.protocol.DECODE_TOKENS` tokens after the cell's first prompt, then the
run's engine does with the run's setting (the prompt is in each engine's prefix cache by then); the
speed-up is the median over those repetitions of (the run's decode tokens/s) / (vLLM's own in the
same repetition). The dense runs are vLLM's own attention: their speed-up is 1 by definition. The
1-minute load average before and after the timing is kept with it. The ``acceptance`` task's runs
are lossless decoding measured in vLLM instead (:mod:`.lossless`: accepted lengths and speed-ups).
"""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..acceptance import AcceptanceTask
from ..config import EvalConfig, SelectorSpec
from ..model import LoadedModel
from ..run_files import Progress, prediction_row, record_failure, write_run
from ..run_plan import RunSpec, run_identity
from ..store import CONFIG, atomic_write_text, clear_run
from ..tasks import ContinuationTask, Sample, get_task
from .agreement import answer_text
from .engine import plugin_config_file, start_engine
from .launch import OWN, EngineError, EngineLaunch, EngineProcess, model_folder
from .lossless import LOSSLESS_DECODE_TOKENS, lossless_run
from .protocol import (DECODE_TOKENS, DTYPE, MAX_NUM_SEQS, TIMING_REPS, cache_salt, kv_cache_gib, process_config,
                       request_setting)

__all__ = ["ServedSweep", "run_served"]


@dataclass
class ServedSweep:
    """What the vLLM path needs of the sweep: the config, the model (its tokenizer makes the
    prompts), the output folder, the engines' Python, a progress bar, a log, ``fail_fast``, the
    run ids by folder, and each cell's prompts once made."""

    cfg: EvalConfig
    lm: LoadedModel
    out: Path
    python: str
    bar: Any
    log: Callable[[str], None]
    fail_fast: bool
    ids: dict[str, str]
    prompts: dict[tuple[str, int], list[tuple[Sample, list[int]]]] = field(default_factory=dict)


def _cell_prompts(sw: ServedSweep, run: RunSpec) -> list[tuple[Sample, list[int]]]:
    """The cell's samples with their token ids (made once per cell; the eval's encoding)."""
    key = (run.task.name, run.length)
    if key not in sw.prompts:
        spec = run.task
        samples = get_task(spec.name, spec.params).make_samples(sw.lm.tokenizer, run.length, spec.depths,
                                                               spec.samples, sw.cfg.seed)
        sw.prompts[key] = [(s, sw.lm.tokenizer.encode(s.prompt, add_special_tokens=True)) for s in samples]
    return sw.prompts[key]


def _max_model_len(sw: ServedSweep, runs: list[RunSpec]) -> int:
    longest = max(len(ids) + max(get_task(r.task.name, r.task.params).max_new_tokens,
                                 LOSSLESS_DECODE_TOKENS if r.task.name == AcceptanceTask.name else DECODE_TOKENS)
                  for r in runs for _, ids in _cell_prompts(sw, r))
    return -(-(longest + 16) // 128) * 128


def _tokens(engine: EngineProcess, run: RunSpec, prompts: list[tuple[Sample, list[int]]], max_tokens: int,
            dense: bool = False) -> list[list[int]]:
    """The greedy tokens of ``run``'s setting (``dense``: none) for each prompt, in one ``generate`` call."""
    setting = None if dense or run.budget is None else request_setting(run.budget)
    salt = None if dense or run.budget is None else cache_salt(run.selector, run.budget)
    reply = engine.request({"op": "generate", "prompts": [
        {"ids": ids, "max_tokens": max_tokens, "setting": setting, "salt": salt} for _, ids in prompts]})
    return reply["tokens"]


def _generate_cell(sw: ServedSweep, own: EngineProcess, engine: EngineProcess, runs: list[RunSpec]
                   ) -> dict[str, Progress]:
    """The rows of ``runs``, the runs of one (task, length) cell on ``engine``, by run folder. Prompt
    major: each wave of :data:`~.protocol.MAX_NUM_SEQS` prompts is answered by every run's setting
    back to back, so a setting whose prompt cache is dense's (no ``cache_salt``: the dense label,
    a generation-only selector's budgets) finds the wave's prompts in vLLM's prefix cache instead of
    prefilling them again: a cell costs prefills, not settings. A run's seconds are its waves'."""
    task = get_task(runs[0].task.name, runs[0].task.params)
    prompts = _cell_prompts(sw, runs[0])
    tokens: dict[str, list[list[int]]] = {r.folder: [] for r in runs}
    seconds = dict.fromkeys(tokens, 0.0)
    for lo in range(0, len(prompts), MAX_NUM_SEQS):
        wave = prompts[lo:lo + MAX_NUM_SEQS]
        for run in runs:
            t0 = time.perf_counter()
            tokens[run.folder] += _tokens(engine, run, wave, task.max_new_tokens)
            seconds[run.folder] += time.perf_counter() - t0
    # a continuation is scored against vLLM's own attention's on the same prompts (the dense run's)
    references = (_tokens(own, runs[0], prompts, task.max_new_tokens, dense=True)
                  if isinstance(task, ContinuationTask) and any(r.selector is not None for r in runs) else None)
    made = {}
    for run in runs:
        p = Progress(seconds=seconds[run.folder])
        for i, ((sample, ids), out) in enumerate(zip(prompts, tokens[run.folder])):
            if isinstance(task, ContinuationTask):
                ref = None if references is None or run.selector is None else references[i]
                row = task.reference_row(out, ref, sw.lm.tokenizer)
            else:
                row = task.answer_row(answer_text(sw.lm.tokenizer, out, task.stop_regex), sample)
            p.rows.append(prediction_row(sample, len(ids), row, []))
            p.fractions.append([])
        made[run.folder] = p
    return made


def _time(engine: EngineProcess, ids: list[int], run: RunSpec | None) -> float:
    """Decode tokens/s of one request of ``run``'s setting (``None``: no setting) after prompt ``ids``."""
    setting = None if run is None or run.budget is None else request_setting(run.budget)
    salt = None if run is None or run.budget is None else cache_salt(run.selector, run.budget)
    reply = engine.request({"op": "time", "ids": ids, "setting": setting, "salt": salt, "tokens": DECODE_TOKENS})
    return float(reply["decode_tok_s"])


def _speed(sw: ServedSweep, own: EngineProcess, engine: EngineProcess, run: RunSpec) -> dict[str, Any]:
    """The run's decode speed-up against vLLM's own attention (module docstring), with the load."""
    ids = _cell_prompts(sw, run)[0][1]
    load0 = os.getloadavg()[0]
    own_tok, mine = [], []
    for _ in range(TIMING_REPS):
        own_tok.append(_time(own, ids, None))
        mine.append(own_tok[-1] if engine is own else _time(engine, ids, run))
    ratios = [m / o for m, o in zip(mine, own_tok)]
    return {"decode_speedup": statistics.median(ratios), "decode_speedup_reps": ratios,
            "decode_tok_s": statistics.median(mine), "own_decode_tok_s": statistics.median(own_tok),
            "load_1m": [round(load0, 2), round(os.getloadavg()[0], 2)]}


def _finish(sw: ServedSweep, run: RunSpec, measure: Callable[[], tuple[Progress, dict[str, Any]]]) -> None:
    """Measure and write one run (``measure``: its rows and extra metrics); a failure is recorded in
    its folder (re-raised with ``fail_fast``)."""
    folder = sw.out / run.folder
    clear_run(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / CONFIG, yaml.safe_dump({"run_id": sw.ids[run.folder],
                                                       "identity": run_identity(sw.cfg, run)}, sort_keys=False))
    sw.bar.set_postfix_str(f"{run.task.name} L={run.length} {run.label} {run.budget.label if run.budget else ''}")
    try:
        p, extra = measure()
    except Exception as err:  # recorded in the run's folder, the sweep goes on (an engine that died fails the rest)
        record_failure(folder, sw.ids[run.folder], err, sw.log)
        if sw.fail_fast:
            raise
        return
    extra["achieved_sparsity"] = 0.0 if run.sparse is None else None  # not measured inside vLLM
    write_run(folder, run, sw.cfg, sw.ids[run.folder], p, extra)
    sw.bar.update(len(p.rows))


def _finish_generated(sw: ServedSweep, own: EngineProcess, engine: EngineProcess, runs: list[RunSpec]) -> None:
    """The generation runs ``runs`` on ``engine``, a cell at a time (:func:`_generate_cell`), each
    timed beside ``own``; a cell whose generation failed fails each of its runs."""
    cells: dict[tuple[str, int], list[RunSpec]] = {}
    for run in runs:
        cells.setdefault((run.task.name, run.length), []).append(run)
    for cell in cells.values():
        try:
            made, err = _generate_cell(sw, own, engine, cell), None
        except Exception as e:  # noqa: BLE001 (recorded in each of the cell's runs by _finish)
            made, err = {}, e
        for run in cell:
            _finish(sw, run, lambda run=run: (_made(made, err, run), _speed(sw, own, engine, run)))


def _made(made: dict[str, Progress], err: Exception | None, run: RunSpec) -> Progress:
    if err is not None:
        raise err
    return made[run.folder]


def _lossless_engine(sw: ServedSweep, run: RunSpec, k: int, max_len: int) -> EngineProcess:
    """The lossless engine of ``run`` (a selector's) at ``K = k``."""
    folder = sw.out / "engines"
    folder.mkdir(exist_ok=True)
    name = f"{run.selector.label}-{run.budget.label}-{run.length}-k{k}"
    mode = str(plugin_config_file(folder / f"{name}.yaml", run.selector.sparse_config(run.budget), sw.cfg.backend))
    sw.log(f"kvsieve eval: starting vLLM engine {name!r} (lossless, plug-in: {mode}; log {folder / (name + '.log')})")
    launch = EngineLaunch(f"{mode}@{k}", threads=sw.cfg.threads or 1,
                          kv_cache_gib=kv_cache_gib(sw.lm.model.config, max_len))
    return start_engine(name, sw.python, model_folder(sw.cfg.model), launch, dtype=DTYPE, max_model_len=max_len,
                        max_num_seqs=MAX_NUM_SEQS, log=folder / f"{name}.log")


def _finish_lossless(sw: ServedSweep, own: EngineProcess, run: RunSpec, runs: list[RunSpec]) -> None:
    """An ``acceptance`` run: lossless decoding measured in vLLM (:mod:`.lossless`)."""
    task, max_len = get_task(run.task.name, run.task.params), _max_model_len(sw, runs)
    _finish(sw, run, lambda: lossless_run(lambda k: _lossless_engine(sw, run, k, max_len), own, run,
                                          _cell_prompts(sw, run), task))


def _engine(sw: ServedSweep, name: str, spec: SelectorSpec | None, runs: list[RunSpec]) -> EngineProcess:
    folder = sw.out / "engines"
    folder.mkdir(exist_ok=True)
    config = None
    if spec is not None:
        config = plugin_config_file(folder / f"{name}.yaml", process_config(spec, min(r.length for r in runs)),
                                    sw.cfg.backend)
    sw.log(f"kvsieve eval: starting vLLM engine {name!r} ({'plug-in: ' + str(config) if config else 'own attention'}"
           f"; log {folder / (name + '.log')})")
    max_len = _max_model_len(sw, runs)
    launch = EngineLaunch(str(config) if config else OWN, threads=sw.cfg.threads or 1,
                          kv_cache_gib=kv_cache_gib(sw.lm.model.config, max_len))
    return start_engine(name, sw.python, model_folder(sw.cfg.model), launch, dtype=DTYPE, max_model_len=max_len,
                        max_num_seqs=MAX_NUM_SEQS, log=folder / f"{name}.log")


def _start(sw: ServedSweep, name: str, spec: SelectorSpec | None, runs: list[RunSpec],
           failing: list[RunSpec]) -> EngineProcess | None:
    """An engine, or ``None`` when it did not start: then each of ``failing`` records why."""
    try:
        return _engine(sw, name, spec, runs)
    except EngineError as err:
        for run in failing:
            record_failure(sw.out / run.folder, sw.ids[run.folder], err, sw.log)
        if sw.fail_fast:
            raise
        return None


def run_served(sw: ServedSweep, runs: list[RunSpec], pending: list[RunSpec]) -> None:
    """Run ``pending`` (a subset of the sweep's ``runs``, in plan order): the dense runs on vLLM's own
    attention, then each selector entry's runs on its engine, timed beside the own engine; the
    ``acceptance`` runs each on lossless engines of their own (:mod:`.lossless`)."""
    own = _start(sw, "own", None, runs, pending)
    if own is None:
        return
    try:
        for run in (r for r in pending if r.task.name == AcceptanceTask.name):
            _finish_lossless(sw, own, run, runs)
        pending = [r for r in pending if r.task.name != AcceptanceTask.name]
        _finish_generated(sw, own, own, [r for r in pending if r.selector is None])
        for spec in sw.cfg.selectors:
            mine = [r for r in pending if r.selector is spec]
            engine = _start(sw, spec.label, spec, runs, mine) if mine else None
            if engine is None:
                continue
            try:
                _finish_generated(sw, own, engine, mine)
            finally:
                engine.close()
    finally:
        own.close()
