"""Markdown rendering of the GPU verification report (the JSON is the record; this is for reading)."""
from __future__ import annotations

__all__ = ["render_markdown"]


def _cases_table(cases: list[dict]) -> list[str]:
    rows = ["| case | kernel | dtype | max err | tol | result | shape |", "|---|---|---|---|---|---|---|"]
    for c in cases:
        rows.append(f"| {c['name']} | {c['kernel']} | {c['dtype']} | {c['max_err']:.3g} | {c['tol']:g} | "
                    f"{'pass' if c['passed'] else 'FAIL'} | {c['shape']} {c['detail']} |")
    return rows


def _bench_table(bench: dict) -> list[str]:
    rows = [f"Peaks used: {bench['hbm_peak_tb_s']:.2f} TB/s HBM, {bench['bf16_peak_tflops']:.0f} TFLOP/s bf16."]
    if "copy_tb_s" in bench:
        rows.append(f"Ceilings measured in this run: copy {bench['copy_tb_s']:.2f} TB/s, bf16 matmul "
                    f"{bench['matmul_tflops']:.0f} TFLOP/s.")
    rows += ["", "| kernel | shape | ms | GB/s | % HBM peak | TFLOP/s | % bf16 peak |", "|---|---|---|---|---|---|---|"]
    for r in bench.get("rows", []):
        if "error" in r:
            rows.append(f"| {r['kernel']} | failed: {r['error']} | | | | | |")
            continue
        rows.append(f"| {r['kernel']} | {r['shape']} | {r['ms']:.3f} | {r['gb_s']:.0f} | {r['pct_hbm']:.0f} | "
                    f"{r['tflops']:.1f} | {r['pct_flops']:.1f} |")
    return rows


def render_markdown(report: dict) -> str:
    """The report as Markdown: meta, one row per step, then each step's details."""
    meta = report["meta"]
    env = meta["environment"]
    lines = [f"# kvsieve GPU check ({'dry run, no GPU' if meta['dry_run'] else env.get('gpu')})", "",
             f"{meta['date']}: **{'OK' if report['ok'] else 'FAILED'}** in {meta['wall_s']} s "
             f"(budget {meta['total_budget_s']:.0f} s)" + (f"; perturb {meta['perturb']}" if meta['perturb'] else ""),
             "", "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), "",
             "| step | what | status | s | budget s | reason |", "|---|---|---|---|---|---|"]
    for s in report["steps"]:
        lines.append(f"| {s['name']} | {s['what']} | {s['status']} | {s['seconds']} | {s['budget_s']:.0f} | "
                     f"{s['reason']} |")
    for s in report["steps"]:
        d = s.get("details")
        if not d:
            continue
        lines += ["", f"## {s['name']}", ""]
        if s["name"] in ("triton_cases", "sanitizer") and isinstance(d, list):
            lines += _cases_table(d)
        elif s["name"] in ("benchmarks", "cute_benchmarks") and isinstance(d, dict):
            lines += _bench_table(d)
        else:
            lines.append("```\n" + (d if isinstance(d, str) else __import__("json").dumps(d, indent=1)) + "\n```")
    return "\n".join(lines) + "\n"
