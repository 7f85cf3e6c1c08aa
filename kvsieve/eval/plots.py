"""PNG plots of a sweep: score against achieved sparsity per task (one line per selector, the
dense score as a horizontal line, one panel per length) and a depth x length heatmap per run
configuration for the needle tasks."""
from __future__ import annotations

import csv
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["write_plots", "NEEDLE_TASKS"]

NEEDLE_TASKS = ("niah_single", "niah_multikey", "passkey")


def write_plots(out: Path, rows: list[dict[str, Any]]) -> list[Path]:
    """Write ``score_vs_sparsity__<task>.png`` and ``heatmap__<task>.png``; returns the paths."""
    if not rows:
        return []
    import matplotlib

    matplotlib.use("Agg")
    paths = []
    for task in sorted({r["task"] for r in rows}):
        task_rows = [r for r in rows if r["task"] == task]
        paths.append(_score_plot(out, task, task_rows))
        if task in NEEDLE_TASKS:
            paths.append(_heatmap(out, task, task_rows))
    return paths


def _score_plot(out: Path, task: str, rows: list[dict[str, Any]]) -> Path:
    import matplotlib.pyplot as plt

    lengths = sorted({int(r["length"]) for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 3.6), squeeze=False, sharey=True)
    for ax, length in zip(axes[0], lengths):
        cell = [r for r in rows if int(r["length"]) == length]
        by_sel: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for r in cell:
            if r["selector"] == "dense":
                ax.axhline(float(r["score"]), color="black", linestyle="--", label="dense")
            else:
                by_sel[r["selector"]].append((float(r["achieved_sparsity"]), float(r["score"])))
        for sel in sorted(by_sel):
            pts = sorted(by_sel[sel])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=sel)
        ax.set_title(f"{task}, {length} tokens")
        ax.set_xlabel("achieved sparsity (decode)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("score")
    axes[0][-1].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    path = out / f"score_vs_sparsity__{task}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _heatmap(out: Path, task: str, rows: list[dict[str, Any]]) -> Path:
    import matplotlib.pyplot as plt

    # one panel per (selector, budget); cells: mean score per (depth, length)
    panels: dict[str, dict[tuple[float, int], list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        name = "dense" if r["selector"] == "dense" else f"{r['selector']} {r['budget_label']}"
        with (out / r["folder"] / "predictions.csv").open(encoding="utf-8") as f:
            for p in csv.DictReader(f):
                if p.get("depth") not in (None, ""):
                    panels[name][(float(p["depth"]), int(r["length"]))].append(float(p["score"]))
    names = sorted(panels, key=lambda n: (n != "dense", n))
    depths = sorted({d for cells in panels.values() for d, _ in cells})
    lengths = sorted({n for cells in panels.values() for _, n in cells})
    cols = min(4, len(names))
    rows_n = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.2 * cols, 2.6 * rows_n), squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    for ax, name in zip(axes.flat, names):
        grid = [[_avg(panels[name].get((d, n), [])) for n in lengths] for d in depths]
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths], fontsize=7)
        ax.set_title(name, fontsize=8)
    fig.suptitle(f"{task}: score by depth (rows) and length (columns)", fontsize=9)
    fig.tight_layout()
    path = out / f"heatmap__{task}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _avg(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan
