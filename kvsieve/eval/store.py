"""Run folders on disk: atomic writes, and the state of a run folder as a resume reads it.

A run folder holds, once the run is finished, ``config.yaml`` (the run's resolved config and its
``run_id``), ``predictions.csv`` (one row per sample) and ``metrics.json`` (written last: with the
right ``run_id`` it marks the run done). While a run is under way, ``partial.json`` keeps the
samples already finished; a failed run leaves ``error.txt`` (error and traceback). Every file is
written to a temporary name and renamed into place, so a kill leaves either the old file or the
new one, never half of one; anything unreadable anyway is reported by name and the run redone.
"""
from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["CONFIG", "PREDICTIONS", "METRICS", "PARTIAL", "ERROR", "RUN_FILES", "RunState", "atomic_write_text",
           "write_csv", "read_state", "clear_run", "discard_leftovers", "diff_identity"]

CONFIG, PREDICTIONS, METRICS = "config.yaml", "predictions.csv", "metrics.json"
PARTIAL, ERROR = "partial.json", "error.txt"
RUN_FILES = (PREDICTIONS, METRICS, CONFIG)
#: metrics.json keys the summary needs; a file without one of them is treated as corrupt
METRIC_KEYS = ("run_id", "score", "ci95", "n", "achieved_sparsity")


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and ``os.replace``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8", newline="") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_csv(path: Path, rows: list[dict[str, Any]], fields: list[str] | tuple[str, ...]) -> None:
    """``rows`` under a header of ``fields``, lines ended by CRLF (RFC 4180): the csv module quotes a
    field holding a character of the line terminator, so a value with a bare ``\r`` (a model's answer
    may hold one) reads back as one field, which it would not with ``\n`` line ends."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(fields), extrasaction="ignore", lineterminator="\r\n")
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(path, buf.getvalue())


@dataclass
class RunState:
    """What a resume finds in a run folder. ``status``: ``new`` (nothing there), ``done`` (reused),
    ``partial`` (some samples finished, ``partial`` holds them), ``failed`` (failed before),
    ``changed`` (made with another config) or ``corrupt`` (a file unreadable or inconsistent);
    ``reason`` says why in words; ``error``: a failed run's error line."""

    status: str
    reason: str = ""
    metrics: dict[str, Any] | None = None
    error: str = ""
    partial: dict[str, Any] = field(default_factory=dict)


def _read_json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    return data


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def diff_identity(old: dict[str, Any], new: dict[str, Any]) -> str:
    """``"seed 0 -> 7, task.samples 1 -> 3"``: the keys whose values differ, compared as the run id
    hashes them (JSON: a tuple and a list with the same items are the same value)."""
    a, b = (_flatten(json.loads(json.dumps(x, default=str))) for x in (old, new))
    keys = sorted(k for k in set(a) | set(b) if a.get(k, "<unset>") != b.get(k, "<unset>"))
    return ", ".join(f"{k} {a.get(k, '<unset>')} -> {b.get(k, '<unset>')}" for k in keys) or "run id differs"


def _changed(folder: Path, identity: dict[str, Any]) -> RunState:
    try:
        old = yaml.safe_load((folder / CONFIG).read_text(encoding="utf-8"))["identity"]
        return RunState("changed", f"config changed: {diff_identity(old, identity)}")
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return RunState("changed", f"config changed ({folder / CONFIG} does not say from what)")


def read_state(folder: Path, run_id: str, identity: dict[str, Any]) -> RunState:
    """The state of the run ``run_id`` (resolved config ``identity``) in ``folder``."""
    metrics_path = folder / METRICS
    if metrics_path.exists():
        try:
            m = _read_json(metrics_path)
        except (OSError, ValueError) as err:
            return RunState("corrupt", f"{metrics_path} is unreadable ({err})")
        missing = [k for k in METRIC_KEYS if k not in m]
        if missing:
            return RunState("corrupt", f"{metrics_path} lacks {missing}")
        if m["run_id"] != run_id:
            return _changed(folder, identity)
        try:
            with (folder / PREDICTIONS).open(encoding="utf-8", newline="") as f:
                n = sum(1 for _ in csv.DictReader(f))
        except (OSError, csv.Error) as err:
            return RunState("corrupt", f"{folder / PREDICTIONS} is unreadable ({err})")
        if n != m["n"]:
            return RunState("corrupt", f"{folder / PREDICTIONS} has {n} rows, {METRICS} says n={m['n']}")
        return RunState("done", metrics=m)
    error_path, partial_path = folder / ERROR, folder / PARTIAL
    if error_path.exists():
        first = error_path.read_text(encoding="utf-8", errors="replace").splitlines()[:2]
        if not first or first[0] != f"run_id: {run_id}":
            return _changed(folder, identity)
        message = first[1] if len(first) > 1 else "no message"
        return RunState("failed", f"failed before ({message})", error=message)
    if partial_path.exists():
        try:
            p = _read_json(partial_path)
            if p.get("run_id") != run_id:
                return _changed(folder, identity)
            if not (isinstance(p.get("rows"), list) and isinstance(p.get("fractions"), list)
                    and len(p["rows"]) == len(p["fractions"])):
                raise ValueError("rows and fractions missing or of different lengths")
        except (OSError, ValueError) as err:
            return RunState("corrupt", f"{partial_path} is unreadable ({err})")
        return RunState("partial", f"resumed after {len(p['rows'])} finished samples", partial=p)
    return RunState("new")


def discard_leftovers(folder: Path) -> None:
    """Remove what a finished run no longer needs: partial.json, an old error.txt, temporary files."""
    for path in (folder / PARTIAL, folder / ERROR, *folder.glob(".*.tmp")):
        path.unlink(missing_ok=True)


def clear_run(folder: Path) -> None:
    """Remove a run's result files (before it is redone from scratch)."""
    for name in RUN_FILES:
        (folder / name).unlink(missing_ok=True)
    discard_leftovers(folder)
