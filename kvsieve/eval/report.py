"""What a sweep shows a person: the summary table (rounded) for the terminal, and ``report.md``, one
Markdown page per sweep linking ``summary.csv``, every plot and every failed run's ``error.txt``."""
from __future__ import annotations

import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from .. import __version__
from .config import EvalConfig
from .served.agreement import Agreement, format_agreement
from .store import ERROR, atomic_write_text

__all__ = ["format_table", "write_report", "table_cells"]

_HEADERS = ("task", "length", "selector", "budget", "tokens", "score", "95% CI", "n", "sparsity", "KL", "status")
_SERVED_HEADERS = ("decode speed-up", "load")


def _num(x: Any, digits: int = 2) -> str:
    if x in (None, ""):
        return "-"
    v = float(x)
    return "nan" if math.isnan(v) else f"{v:.{digits}f}"


def _interval(low: Any, high: Any) -> str:
    """``[low, high]``, or ``n/a`` when the interval is undefined (one continuous score: ``nan`` bounds)."""
    if any(x in (None, "") or math.isnan(float(x)) for x in (low, high)):
        return "n/a"
    return f"[{_num(low)}, {_num(high)}]"


def _served(rows: list[dict[str, Any]]) -> bool:
    return any("decode_speedup" in r for r in rows)


def _headers(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """The table's headers; the vLLM path's rows add the decode speed-up and the load."""
    return _HEADERS[:-1] + (_SERVED_HEADERS if _served(rows) else ()) + _HEADERS[-1:]


def table_cells(rows: list[dict[str, Any]]) -> list[list[str]]:
    """One list of strings per summary row, in the order of :func:`_headers`."""
    out = []
    served = _served(rows)
    for r in rows:
        ok = r["status"] == "ok"
        ci = _interval(r.get("ci95_low"), r.get("ci95_high")) if ok else "-"
        cells = [str(r["task"]), str(r["length"]), str(r["selector"]), str(r["budget_label"]),
                 str(r["budget_tokens"]), _num(r.get("score")) if ok else "-", ci,
                 str(r.get("n") or "-"), _num(r.get("achieved_sparsity")) if ok else "-", _num(r.get("kl"), 3)]
        if served:
            load = r.get("load_1m")
            cells += [_num(r.get("decode_speedup")) if ok else "-",
                      "-" if not ok or not load else "-".join(f"{x:.1f}" for x in load)]
        out.append(cells + ["ok" if ok else f"FAILED: {r.get('error', '')}"])
    return out


def format_table(rows: list[dict[str, Any]]) -> str:
    """The summary as an aligned text table (scores and sparsities to two decimals)."""
    headers = _headers(rows)
    cells = [list(headers)] + table_cells(rows)
    widths = [max(len(c[i]) for c in cells) for i in range(len(headers) - 1)]
    lines = ["  ".join(c[i].ljust(w) for i, w in enumerate(widths)) + "  " + c[-1] for c in cells]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def write_report(out: Path, cfg: EvalConfig, rows: list[dict[str, Any]], plots: list[Path],
                 agreement: list[Agreement] | None = None, agree_with: str | Path | None = None) -> Path:
    """Write ``<out>/report.md``; links are relative, so the folder can be moved or zipped.
    ``agreement``: the per-prompt comparison with the output folder ``agree_with``, as a section."""
    ok = sum(r["status"] == "ok" for r in rows)
    failed = [r for r in rows if r["status"] != "ok"]
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    headers = _headers(rows)
    lines = [f"# kvsieve eval: {out.name}", "",
             f"Model `{cfg.model}`, engine `{cfg.engine}`, backend `{cfg.backend}`, seed {cfg.seed}, kvsieve "
             f"{__version__}; written {when}.",
             f"{len(rows)} runs: {ok} ok, {len(failed)} failed. Score: the task's metric (fidelity: attention-mass "
             "recall); 95% CI: Wilson for 0/1 scores, else normal; sparsity: achieved while decoding.", ""]
    if _served(rows):
        lines += ["Through vLLM (`--engine vllm`): dense = vLLM's own attention; each selector's `dense` budget = "
                  "dense attention through the plug-in. Sparsity is not measured inside vLLM (`-`; "
                  "`target_sparsity` in summary.csv). Decode speed-up: the run's decode tokens/s over vLLM's own "
                  "attention's at the same length, median of paired measurements in this run; load: the 1-minute "
                  "load average before and after its timing. frontier__<task>.png: score against decode speed-up.",
                  ""]
    lines += ["Files: [summary.csv](summary.csv)" + "".join(f", [{p.name}]({p.name})" for p in plots), "",
              "## Results", "", "| " + " | ".join(headers) + " | run |", "|" + "---|" * (len(headers) + 1)]
    for r, c in zip(rows, table_cells(rows)):
        lines.append("| " + " | ".join(c) + f" | [{r['folder']}]({r['folder']}/) |")
    if agreement is not None:
        lines += ["", f"## Agreement with {agree_with}", "", "[agreement.csv](agreement.csv)", "", "```",
                  format_agreement(agreement), "```"]
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{p.stem}]({p.name})" for p in plots]
    if failed:
        lines += ["", "## Failed runs", ""]
        lines += [f"- [{r['folder']}]({r['folder']}/{ERROR}): {r.get('error', '')}" for r in failed]
    lines += ["", "## Config", "", "```yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip(), "```", ""]
    path = out / "report.md"
    atomic_write_text(path, "\n".join(lines))
    return path
