"""PNG plots of a sweep.

``score_vs_sparsity__<task>.png``: the task's metric (named on the axis: fidelity's is the
attention-mass recall) against the achieved decode sparsity, one panel per length, one line per
selector with each point labelled by its budget and a 95% error bar (Wilson's interval for 0/1
scores, from n), the dense score as a dashed line with its interval shaded.

``heatmap__<task>.png`` (needle tasks): mean score by depth (rows) and length (columns), one panel
per run configuration (dense first, then each selector by increasing budget), each cell printed,
one shared colorbar. A sweep of a single length is drawn as one panel, a row per run
configuration and a column per depth, instead of a page of one-column panels.

``frontier__<task>.png`` (the vLLM path, rows with a ``decode_speedup``): the task's metric against
the decode speed-up over vLLM's own attention, one panel per length, one line per selector (points
labelled by budget, 95% error bars), dense (vLLM's own attention, speed-up 1) as a dashed line with
its interval shaded. There the sparsity plot's x is the target sparsity (vLLM does not report the
achieved one).
"""
from __future__ import annotations

import csv
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from ..terminal import deferred_interrupt
from .tasks import get_task

__all__ = ["write_plots", "NEEDLE_TASKS"]

NEEDLE_TASKS = ("niah_single", "niah_multikey", "passkey")


def write_plots(out: Path, rows: list[dict[str, Any]]) -> list[Path]:
    """Plots of the finished runs ``rows`` (summary rows) into ``out``; returns their paths."""
    if not rows:
        return []
    with deferred_interrupt():  # a Ctrl-C during the import would break matplotlib's compiled modules
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    paths = []
    for task in sorted({r["task"] for r in rows}):
        task_rows = [r for r in rows if r["task"] == task]
        paths.append(_score_plot(out, task, task_rows))
        if any(r.get("decode_speedup") not in (None, "") for r in task_rows):
            paths.append(_frontier(out, task, task_rows))
        if task in NEEDLE_TASKS:
            paths.append(_heatmap(out, task, task_rows))
    return paths


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    os.replace(tmp, path)
    return path


def _f(x: Any) -> float:
    return math.nan if x in (None, "") else float(x)


def _sparsity(r: dict[str, Any]) -> float:
    """The achieved sparsity, or the target where none was measured (the vLLM path)."""
    x = _f(r["achieved_sparsity"])
    return _f(r["target_sparsity"]) if math.isnan(x) else x


def _score_plot(out: Path, task: str, rows: list[dict[str, Any]]) -> Path:
    measured = all(not math.isnan(_f(r["achieved_sparsity"])) for r in rows)
    xlabel = "achieved sparsity while decoding" if measured else "target sparsity (achieved not measured)"
    return _panels(out, f"score_vs_sparsity__{task}.png", task, rows, _sparsity, xlabel, "sparsity")


def _frontier(out: Path, task: str, rows: list[dict[str, Any]]) -> Path:
    rows = [r for r in rows if r.get("decode_speedup") not in (None, "")]
    return _panels(out, f"frontier__{task}.png", task, rows, lambda r: _f(r["decode_speedup"]),
                   "decode speed-up over vLLM's own attention", "decode speed-up", order=_sparsity)


def _panels(out: Path, name: str, task: str, rows: list[dict[str, Any]], xof: Any, xlabel: str, what: str,
            order: Any = None) -> Path:
    """One panel per length: dense as a dashed line (interval shaded), each selector a line of its
    budgets at ``xof(row)`` with 95% error bars, joined in ``order(row)`` (default: ``xof``)."""
    import matplotlib.pyplot as plt

    metric = get_task(task).metric
    lengths = sorted({int(r["length"]) for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(max(6.4, 4.6 * len(lengths)), 4.2), squeeze=False, sharey=True)
    for ax, length in zip(axes[0], lengths):
        cell = [r for r in rows if int(r["length"]) == length]
        by_sel: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in cell:
            if r["selector"] == "dense":
                ax.axhline(_f(r["score"]), color="black", linestyle="--", label=f"dense (n={r['n']})")
                ax.axhspan(_f(r["ci95_low"]), _f(r["ci95_high"]), color="black", alpha=0.07)
            else:
                by_sel[r["selector"]].append(r)
        for sel in sorted(by_sel):
            pts = sorted(by_sel[sel], key=order or xof)
            x = [xof(r) for r in pts]
            y = [_f(r["score"]) for r in pts]
            err = [[max(0.0, yi - _f(r["ci95_low"])) for yi, r in zip(y, pts)],
                   [max(0.0, _f(r["ci95_high"]) - yi) for yi, r in zip(y, pts)]]
            line = ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=sel)
            for xi, yi, r in zip(x, y, pts):
                ax.annotate(r["budget_label"], (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7,
                            color=line[0].get_color())
        ax.set_title(f"{task}, {length} tokens", fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylim(-0.05, 1.08)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(metric)
    axes[0][-1].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"{task}: {metric} against {what}\n(point labels: budget; bars: 95% interval)", fontsize=9)
    fig.tight_layout()
    return _save(fig, out / name)


def _panel_key(r: dict[str, Any]) -> tuple[bool, str, float]:
    return (r["selector"] != "dense", r["selector"], _f(r["budget_tokens"]))


def _heatmap(out: Path, task: str, rows: list[dict[str, Any]]) -> Path:
    import matplotlib.pyplot as plt

    panels: dict[str, dict[tuple[float, int], list[float]]] = {}
    for r in sorted(rows, key=_panel_key):
        name = "dense" if r["selector"] == "dense" else f"{r['selector']} {r['budget_label']}"
        cells = panels.setdefault(name, defaultdict(list))
        with (out / r["folder"] / "predictions.csv").open(encoding="utf-8", newline="") as f:
            for p in csv.DictReader(f):
                if p.get("depth") not in (None, ""):
                    cells[(float(p["depth"]), int(r["length"]))].append(float(p["score"]))
    names = list(panels)
    depths = sorted({d for cells in panels.values() for d, _ in cells})
    lengths = sorted({n for cells in panels.values() for _, n in cells})
    metric = get_task(task).metric
    if len(lengths) == 1:  # one length: one panel, a row per run configuration, a column per depth
        grid = [[_avg(panels[n].get((d, lengths[0]), [])) for d in depths] for n in names]
        fig, ax = plt.subplots(figsize=(3.4 + 0.9 * len(depths), 0.9 + 0.32 * len(names)), constrained_layout=True)
        im = _draw(ax, grid, [f"depth {d:g}%" for d in depths], names)
        ax.set_title(f"{task}, {lengths[0]} tokens: {metric}", fontsize=9)
        fig.colorbar(im, ax=ax, label=metric)
        return _save(fig, out / f"heatmap__{task}.png")
    cols = min(4, len(names))
    rows_n = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.3 * cols + 1.0, 2.7 * rows_n), squeeze=False,
                             constrained_layout=True)
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    im = None
    for ax, name in zip(axes.flat, names):
        grid = [[_avg(panels[name].get((d, n), [])) for n in lengths] for d in depths]
        im = _draw(ax, grid, [str(n) for n in lengths], [f"{d:g}%" for d in depths])
        ax.set_title(name, fontsize=8)
    fig.colorbar(im, ax=axes.ravel().tolist(), label=metric)
    fig.suptitle(f"{task}: {metric} by needle depth (rows) and length in tokens (columns)", fontsize=9)
    return _save(fig, out / f"heatmap__{task}.png")


def _draw(ax: Any, grid: list[list[float]], xlabels: list[str], ylabels: list[str]) -> Any:
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, "n/a" if math.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(xlabels)), xlabels, fontsize=7)
    ax.set_yticks(range(len(ylabels)), ylabels, fontsize=7)
    return im


def _avg(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan
