"""What a finished or failed run writes into its folder, whichever engine ran it: the prediction
rows, ``predictions.csv`` then ``metrics.json`` (its presence marks the run done), or ``error.txt``.
The folder's protocol (atomic writes, what a resume reads) is :mod:`.store`'s."""
from __future__ import annotations

import json
import math
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from .. import __version__
from .config import EvalConfig
from .memory import rss_mb
from .metrics import mean_ci95
from .run_plan import DENSE, RunSpec
from .store import ERROR, METRICS, PARTIAL, PREDICTIONS, atomic_write_text, discard_leftovers, write_csv
from .tasks import Sample, get_task

__all__ = ["Progress", "prediction_row", "write_run", "record_failure", "OPTIONAL_METRICS"]

OPTIONAL_METRICS = ("partial", "mass_recall", "rel_error", "topk_overlap", "kl", "accepted_length_k2",
                    "accepted_length_k4", "accepted_length_k8")


@dataclass
class Progress:
    """A run's finished samples: prediction rows, per-sample attended fractions per layer (``None``
    entries: not measured), seconds."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    fractions: list[list[float | None]] = field(default_factory=list)
    seconds: float = 0.0
    failed: bool = False


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def prediction_row(sample: Sample, num_tokens: int, row: dict[str, Any], frac: list[float | None]) -> dict[str, Any]:
    """One ``predictions.csv`` row: the sample, its prompt length, the task's row (``_`` keys dropped)
    and the mean attended fraction over the layers that measured one."""
    seen = [f for f in frac if f is not None]
    base = {"sample": sample.index, "depth": sample.depth, "prompt_tokens": num_tokens,
            "answers": "|".join(sample.answers), "attended_fraction": _mean(seen)}
    base.update({k: v for k, v in row.items() if not k.startswith("_")})
    return base


def write_run(folder: Path, run: RunSpec, cfg: EvalConfig, run_id: str, p: Progress,
              extra: dict[str, Any] | None = None) -> None:
    """The finished run's predictions.csv, then metrics.json (its presence marks the run done);
    ``extra``: more metrics, replacing those of the same name (the vLLM path's decode speed-up)."""
    per_layer = []
    for layer in zip(*p.fractions):
        vals = [v for v in layer if v is not None]
        per_layer.append(_mean(vals) if vals else None)
    seen = [v for v in per_layer if v is not None]
    binary = get_task(run.task.name, run.task.params).binary_score
    score, lo, hi = mean_ci95([float(r["score"]) for r in p.rows], binary=binary)
    metrics: dict[str, Any] = {
        "run_id": run_id, **run.describe(), "selector_name": run.sparse.selector if run.sparse else DENSE,
        "score": score, "ci95": [lo, hi], "n": len(p.rows),
        "achieved_sparsity": 1 - _mean(seen) if seen else 0.0, "attended_fraction_per_layer": per_layer,
        "wall_time_s": p.seconds, "peak_rss_mb": rss_mb()[0],
        "shares_prefill": run.shares_prefill and cfg.share_prefill,
        "backend": cfg.backend, "engine": cfg.engine,
        "kvsieve_version": __version__, "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **(extra or {}),
    }
    for key in OPTIONAL_METRICS:
        if p.rows and key in p.rows[0]:
            metrics[key] = _mean([float(r[key]) for r in p.rows])
    if p.rows and "mass_recall_per_layer" in p.rows[0]:  # fidelity: each layer's recall, mean over samples
        layers = zip(*([float(x) for x in str(r["mass_recall_per_layer"]).split("|")] for r in p.rows))
        metrics["mass_recall_per_layer"] = [_mean(list(v)) for v in layers]
    write_csv(folder / PREDICTIONS, p.rows, list(p.rows[0]))
    atomic_write_text(folder / METRICS, json.dumps(metrics, indent=2))
    discard_leftovers(folder)


def record_failure(folder: Path, run_id: str, err: BaseException, log: Callable[[str], None]) -> None:
    """``error.txt`` (run id, the error's first line, the traceback) in the run's folder; logs one line."""
    message = f"{type(err).__name__}: {err}".splitlines()[0]
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / ERROR, f"run_id: {run_id}\n{message}\n\n{traceback.format_exc()}")
    (folder / PARTIAL).unlink(missing_ok=True)
    log(f"kvsieve eval: run {folder.name} failed: {message} (traceback in {folder / ERROR})")
