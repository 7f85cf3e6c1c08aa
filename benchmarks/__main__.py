"""``python -m benchmarks``: the CPU suite (metadata prepare, CPU attention, selector overhead), then —
on a CUDA machine — the kernel benchmark scripts that exist (``triton_kernels``, ``cute_kernels``,
``topk``). Writes ``performance.json`` and the Markdown tables ``performance.md`` into ``--out``
(default ``bench_out/``, gitignored); the tracked ``docs/results/performance.{json,md}`` are rewritten only
with ``--update-docs``. Both carry the exact command, date, torch threads and the machine's load
(``os.getloadavg``: 1, 5 and 15 minutes) at the start and the end of the run.

Figures are medians of repeated runs after a warm-up, with the spread ``[min, max]`` and the 1-minute
load average when each was taken. ``--quick`` runs tiny sizes in seconds (what the tests run).
``--e2e-baseline`` (a path or ``git:<rev>:<path>``) names an earlier run's JSON whose e2e tokens/s
and per-layer profile the e2e section shows as "before" beside this run's.
``--threads`` sets torch's intra-op threads (default 1: on a shared, oversubscribed machine two
spinning OpenMP threads make small ops an order of magnitude slower and the figures meaningless).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from . import cpu_attention, e2e, e2e_report, prepare, selector_overhead
from ._timing import fmt_ms, load_average, load_averages

__all__ = ["main", "run", "render_markdown", "GPU_MODULES", "SECTIONS"]

SECTIONS = ("prepare", "cpu_attention", "selector_overhead", "e2e")
GPU_MODULES = ("triton_kernels", "cute_kernels", "topk")
SCHEMA_VERSION = 2
DEFAULT_OUT = "bench_out"
SELECTOR_OVERHEAD_MAX = 0.25  # issue #17 target 3: a selector costs at most a quarter of what it saves
# selectors (by their label in the table) the overhead target does not bind, with the reason
SELECTOR_OVERHEAD_EXEMPT = {
    "oracle_topk": "the upper bound by construction",
    "block_select (exact)": "an option that reads every key by definition; the summary mode is the practical one",
}
DECODE_SPARSEST, DECODE_MIN_OF_IDEAL = 64, 0.6  # issue #17 target 4: sparse decode at 1/64 >= 60% of 64x
DOCS_DIR = Path(__file__).resolve().parents[1] / "docs" / "results"


def _gpu_suites(quick: bool) -> dict:
    out = {}
    if not torch.cuda.is_available():
        return {"skipped": "CUDA not available"}
    for name in GPU_MODULES:
        mod_name = f"{__package__}.{name}"
        if importlib.util.find_spec(mod_name) is None:
            out[name] = {"status": "absent"}
            continue
        t0 = time.perf_counter()
        try:
            mod = importlib.import_module(mod_name)
            status, res = _call_main(mod, quick)
            out[name] = {"status": status, "wall_s": time.perf_counter() - t0,
                         "result": res if _jsonable(res) else repr(res)[:2000]}
        except Exception:  # noqa: BLE001 - one failing kernel script must not sink the report
            out[name] = {"status": "error", "error": traceback.format_exc()[-2000:]}
    return out


def _call_main(mod, quick: bool) -> tuple[str, object]:
    """``mod.main(argv)``; ``--quick`` when asked and the script's parser takes it (an argparse usage
    error, exit 2, retries with no arguments). An int return or ``SystemExit`` code is the status."""
    for argv in ([["--quick"], []] if quick else [[]]):
        try:
            res = mod.main(argv)
        except SystemExit as e:
            if e.code == 2 and argv:
                continue
            return ("ok" if not e.code else f"exit {e.code}"), None
        if isinstance(res, int) and not isinstance(res, bool):
            return ("ok" if res == 0 else f"exit {res}"), res
        return "ok", res
    return "error", None


def _jsonable(x) -> bool:
    try:
        json.dumps(x)
        return True
    except (TypeError, ValueError):
        return False


def run(quick: bool = False, threads: int = 1, sections: tuple[str, ...] = SECTIONS, compile_flex: bool = True,
        gpu: bool = True, command: str = "python -m benchmarks", e2e_lengths: list[int] | None = None,
        e2e_baseline: str | None = None) -> dict:
    """Run the asked sections; ``command`` is recorded as given (the command line that asked);
    ``e2e_lengths``: the e2e group's context lengths (default :class:`benchmarks.e2e.E2EConfig`'s);
    ``e2e_baseline``: an earlier run's performance.json whose e2e figures the e2e section shows as
    "before" (read first: a bad file fails before anything runs)."""
    baseline = None
    if e2e_baseline is not None:
        if "e2e" not in sections:
            raise ValueError("--e2e-baseline needs the e2e section in this run (--only ... e2e)")
        baseline = e2e_report.baseline_from(json.loads(_read_spec(e2e_baseline)), e2e_baseline)
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    meta = {
        "schema_version": SCHEMA_VERSION, "command": command,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "quick": quick,
        "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "load_1m_start": load_average(),
        "loadavg_start": load_averages(), "cuda": torch.cuda.is_available(),
    }
    res: dict = {"meta": meta}
    if "prepare" in sections:
        res["prepare"] = prepare.run(quick)
    if "cpu_attention" in sections:
        res["cpu_attention"] = cpu_attention.run(quick, compile_flex and not quick)
    if "selector_overhead" in sections:
        res["selector_overhead"] = selector_overhead.run(quick)
    if "e2e" in sections:
        res["e2e"] = e2e.run(e2e.config_from(quick, e2e_lengths, None))
        if baseline is not None:
            res["e2e"]["baseline"] = baseline
    if gpu:
        res["gpu"] = _gpu_suites(quick)
    meta["load_1m_end"] = load_average()
    meta["loadavg_end"] = load_averages()
    meta["wall_s"] = time.perf_counter() - t0
    res["targets"] = _targets(res)
    return res


def _read_spec(spec: str) -> str:
    """The text of ``spec``: a file path, or ``git:<rev>:<path>`` (that file at that commit of this
    repository, e.g. ``git:HEAD~3:docs/results/performance.json``)."""
    if not spec.startswith("git:"):
        return Path(spec).read_text()
    rev, _, path = spec[4:].partition(":")
    if not rev or not path:
        raise ValueError(f"{spec}: expected git:<rev>:<path>, e.g. git:HEAD~3:docs/results/performance.json")
    proc = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=DOCS_DIR.parent, capture_output=True, text=True)
    if proc.returncode:
        raise ValueError(f"{spec}: git show failed: {proc.stderr.strip()}")
    return proc.stdout


def _targets(res: dict) -> list[dict]:
    """Every target row of the sections in ``res``, each naming the ``section`` that measured it."""
    out = []
    if "prepare" in res:
        t = res["prepare"]["target"]
        for tr, v in t["per_translation"].items():
            out.append({"section": "prepare", "target": f"prepare {tr} >= {t['min_speedup']:.0f}x the list baseline at B={t['batch']}, "
                                  f"{t['context'] // 1024}K tokens, page {t['page']}",
                        "value": v["speedup"], "met": v["met"]})
        s = res["prepare"].get("offsets_scaling_summary") or {}
        if s:
            worst = max(s["capped_time_ratio_largest_vs_smallest_capacity"].values())
            out.append({"section": "prepare", "target": "capped block-offset copy independent of table capacity (time ratio, "
                                  f"capacity {s['capacities'][-1] // 1024}K vs {s['capacities'][0] // 1024}K tokens; <= 1.5)",
                        "value": worst, "met": worst <= 1.5})
    if "cpu_attention" in res:
        t = res["cpu_attention"]["target"]
        out.append({"section": "cpu_attention", "target": f"torch sparse decode >= {t['min_speedup']:.0f}x dense SDPA at "
                              f"{t['context'] // 1024}K context, density 1/{t['reduction_factor']}",
                    "value": t.get("speedup"), "met": t.get("met") if t.get("measured") else None})
        for r in res["cpu_attention"]["prefill"]:  # issue #17 target 2: at FlexAttention's level
            compiled = r["flex_mode"] == "compiled" and r["speedup_vs_flex"] is not None
            out.append({"section": "cpu_attention", "target": f"torch block-sparse prefill >= compiled FlexAttention, {r['length'] // 1024}K, "
                                  f"density {r['density']} (speed ratio; flex {r['flex_mode']})",
                        "value": r["speedup_vs_flex"], "met": r["speedup_vs_flex"] >= 1.0 if compiled else None})
        sparsest = [r for r in res["cpu_attention"]["decode"] if r["reduction_factor"] == DECODE_SPARSEST]
        if sparsest:  # issue #17 target 4
            worst = min(sparsest, key=lambda r: r["fraction_of_ideal"])
            out.append({"section": "cpu_attention", "target": f"torch sparse decode at 1/{DECODE_SPARSEST} >= {DECODE_MIN_OF_IDEAL:.0%} of the "
                                  f"ideal {DECODE_SPARSEST}x over dense SDPA, every context (worst: "
                                  f"{worst['context'] // 1024}K; fraction of ideal)",
                        "value": worst["fraction_of_ideal"], "met": worst["fraction_of_ideal"] >= DECODE_MIN_OF_IDEAL})
    for shape in res.get("selector_overhead", {}).get("shapes", []):
        cfg = shape["config"]
        for r in shape["selectors"]:
            label = r["selector"] + (f" ({r['config']['scoring']})" if "scoring" in r["config"] else "")
            f = r["overhead_fraction_of_saved"]
            exempt = SELECTOR_OVERHEAD_EXEMPT.get(label)
            out.append({"section": "selector_overhead", "target": f"{label} selector step <= {SELECTOR_OVERHEAD_MAX} of the attention time it saves "
                                  f"(batch {cfg['batch']}, {cfg['context']} tokens, budget 1/{cfg['budget_inv']})"
                                  + (f" [exempt: {exempt}]" if exempt else ""),
                        "value": f, "met": None if f is None or exempt else f <= SELECTOR_OVERHEAD_MAX})
    if "e2e" in res:
        out += [{"section": "e2e", **t} for t in res["e2e"]["targets"]]
    return out


def _ms(t: dict | None) -> str:
    if t is None:
        return "n/a"
    return f"{fmt_ms(t['median_s'])} [{fmt_ms(t['min_s'])}, {fmt_ms(t['max_s'])}]"


def _x(v: float | None, digits: int = 1) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}x"


def _load(v: list[float]) -> str:
    return "/".join(f"{x:.2f}" for x in v)


def _yes(v: bool | None) -> str:
    return "n/a" if v is None else ("met" if v else "MISSED")


def _provenance(res: dict, section: str) -> list[str]:
    """A line naming the earlier run a section kept by :func:`merge_into_docs` comes from (above its heading)."""
    m = res.get("earlier", {}).get(section)
    if m is None:
        return []
    # runs before schema 2 recorded neither the command nor the 5/15-minute load averages
    command = f"`{m['command']}`" if "command" in m else "`python -m benchmarks` (command not recorded)"
    start, end = ((_load(m["loadavg_start"]), _load(m["loadavg_end"])) if "loadavg_start" in m
                  else (f"{m['load_1m_start']:.2f} (1 min)", f"{m['load_1m_end']:.2f} (1 min)"))
    return ["", f"*The next section ({section}) is from an earlier run:* {command} on {m['date']}, torch threads "
                f"{m['torch_threads']}, load average {start} at start and {end} at the end."]


def merge_into_docs(res: dict, old: dict | None) -> dict:
    """``res`` plus the sections of ``old`` (the tracked docs' JSON) that this run did not measure,
    each keeping the meta of the run that measured it (``res["earlier"][section]``); targets are
    recomputed over the merged sections."""
    merged = dict(res)
    earlier = {}
    if old is not None:
        for section in (*SECTIONS, "gpu"):
            if section not in res and section in old:
                merged[section] = old[section]
                earlier[section] = old.get("earlier", {}).get(section, old["meta"])
    if earlier:
        merged["earlier"] = earlier
    merged["targets"] = _targets(merged)
    return merged


def render_markdown(res: dict) -> str:
    m = res["meta"]
    lines = [
        "# kvsieve performance (CPU suite)", "",
        f"Generated by `{m['command']}` on {m['date']}: torch {m['torch']}, "
        f"Python {m['python']}, {m['cpu_count']} CPUs ({m['cpu_capability']}), torch threads {m['torch_threads']}, "
        f"load average (1, 5, 15 min) {_load(m['loadavg_start'])} at start and {_load(m['loadavg_end'])} at the end, "
        f"wall {m['wall_s']:.0f} s.",
        "",
        "Times are medians after a warm-up, `[min, max]` over the timed runs, in milliseconds; the `load` column is "
        "the 1-minute load average (`uptime`) when that row was measured. The machine is shared: a load above the "
        "CPU count means other processes were competing for the cores."
        + (" Sections measured in an earlier run (this one ran only some) name that run above their heading."
           if res.get("earlier") else ""), "",
        "## Targets", "", "| target | measured | verdict | measured on |", "|---|---|---|---|",
    ]
    for t in res.get("targets", []):
        v = t["value"]
        when = res.get("earlier", {}).get(t.get("section"), m)["date"]
        lines.append(f"| {t['target']} | {'n/a' if v is None else f'{v:.2f}'} | {_yes(t['met'])} | {when} |")
    if "prepare" in res:
        p = res["prepare"]
        lines += _provenance(res, "prepare")
        lines += ["", "## `AttentionMetadata.prepare()` per translation vs a per-request Python-list baseline", "",
                  "Decode step (one new token per request). The baseline (in `benchmarks/prepare.py`) keeps a Python "
                  "list of block ids per request and builds each table with `list.extend` per request, then "
                  "`torch.tensor`; its tables are checked equal to the library's (`match`). Baseline skipped above "
                  f"{p['baseline_max_blocks']:,} blocks.", "",
                  "| translation | batch | context | page | blocks | prepare ms | baseline ms | speedup | match | us/request | load |",
                  "|---|---:|---:|---:|---:|---|---|---:|---|---:|---:|"]
        for r in p["grid"]:
            lines.append(f"| {r['translation']} | {r['batch']} | {r['context']} | {r['page']} | {r['blocks']:,} | "
                         f"{_ms(r['library'])} | {_ms(r['baseline'])} | {_x(r['speedup'])} | "
                         f"{'n/a' if r['baseline_matches'] is None else r['baseline_matches']} | "
                         f"{r['us_per_request']:.2f} | {r['library']['load_1m']} |")
        lines += ["", "### Block-offset copy: capped vs speculative width, by table capacity", "",
                  "| batch | context | page | capacity (tokens) | capped ms | speculative ms | capped us/request | load |",
                  "|---:|---:|---:|---:|---|---|---:|---:|"]
        for r in p["offsets_scaling"]:
            lines.append(f"| {r['batch']} | {r['context']} | {r['page']} | {r['capacity_tokens']} | {_ms(r['capped'])} | "
                         f"{_ms(r['speculative'])} | {r['capped_us_per_request']:.2f} | {r['capped']['load_1m']} |")
    if "cpu_attention" in res:
        c = res["cpu_attention"]
        bw = c["copy_bandwidth"]
        d = c["config"]["decode"]
        lines += _provenance(res, "cpu_attention")
        lines += ["", "## CPU sparse decode (`torch` backend) vs dense SDPA", "",
                  f"Batch 1, Hq={d['hq']}, Hkv={d['hkv']}, D={d['d']}, fp32 HND cache, page {d['page']}, block-sparse "
                  f"selection at page granularity. Memory-copy bandwidth in this run: {bw['gb_per_s']:.1f} GB/s "
                  f"(median; best {bw['gb_per_s_best']:.1f}). `GB/s` = K+V bytes read through the block table / time; "
                  "`path`: the backend's path (`sparse_runs_native`: the native C kernel reads the runs in place; "
                  "`sparse_runs`: gather, then PyTorch's flash kernel). `of ideal` above 100% means the sparse path "
                  "reads its bytes faster than dense SDPA reads the whole contiguous cache (SDPA here: "
                  f"{min(r['sdpa_dense_gb_per_s'] for r in c['decode']):.1f}-"
                  f"{max(r['sdpa_dense_gb_per_s'] for r in c['decode']):.1f} GB/s).", "",
                  "| context | density | path | sparse ms | dense SDPA ms | speedup | ideal | of ideal | read GB/s | of copy BW | max err | load |",
                  "|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in c["decode"]:
            lines.append(f"| {r['context']} | {r['density']} | {r['path']} | {_ms(r['sparse'])} | {_ms(r['sdpa_dense'])} | "
                         f"{_x(r['speedup_vs_sdpa'])} | {r['ideal_speedup']:.0f}x | {r['fraction_of_ideal']:.0%} | "
                         f"{r['gathered_gb_per_s']:.2f} | {r['fraction_of_copy_bandwidth']:.0%} | "
                         f"{r['max_abs_err_vs_masked_sdpa']:.1e} | {r['sparse']['load_1m']} |")
        pf = c["config"]["prefill"]
        fl = c["flex"]
        lines += ["", "## CPU block-sparse prefill (`torch` backend) vs FlexAttention and dense causal SDPA", "",
                  f"One request, Hq={pf['hq']}, Hkv={pf['hkv']}, D={pf['d']}, fp32, query/KV blocks of {pf['block']}: "
                  "per query block the diagonal block plus random earlier blocks. FlexAttention: "
                  f"**{fl.get('mode')}**" + (f" (compile error: `{fl['compile_error']}`)" if fl.get("compile_error") else "")
                  + (f", compile time {', '.join(f'{v:.0f} s' for v in fl['compile_s'].values())}" if fl.get("compile_s") else "")
                  + ". The torch backend gathers each query block's runs once (tokens naming the same blocks share "
                  "the gather); the runs every token of the block reads whole go through PyTorch's fused CPU flash "
                  "kernel with no mask (the group's query heads folded into its rows), the diagonal runs through one "
                  "masked call, merged by log-sum-exp; FlexAttention visits only the selected blocks.", "",
                  "| length | density | blocks visited | sparse ms | flex ms | dense SDPA ms | vs SDPA | vs flex | max err vs flex | load |",
                  "|---:|---|---:|---|---|---|---:|---:|---:|---:|"]
        for r in c["prefill"]:
            err = r["max_abs_err_vs_flex"]
            lines.append(f"| {r['length']} | {r['density']} | {r['kv_blocks_visited_fraction']:.0%} | {_ms(r['sparse'])} | "
                         f"{_ms(r['flex'])} ({r['flex_mode']}) | {_ms(r['sdpa_dense_causal'])} | {_x(r['speedup_vs_sdpa'], 2)} | "
                         f"{_x(r['speedup_vs_flex'], 2)} | {'n/a' if err is None else f'{err:.1e}'} | {r['sparse']['load_1m']} |")
    if "selector_overhead" in res:
        lines += _provenance(res, "selector_overhead")
        for s in res["selector_overhead"]["shapes"]:
            cfg = s["config"]
            lines += ["", f"## Selector host overhead per decode step (batch {cfg['batch']}, context {cfg['context']})", "",
                      f"Hq={cfg['hq']}, Hkv={cfg['hkv']}, D={cfg['d']}, page {cfg['page']}, budget ~1/{cfg['budget_inv']} "
                      f"of the context; one layer. Dense torch-backend attention: {_ms(s['dense_attention'])} ms. "
                      "`overhead / saved` = selector step time / (dense - sparse attention time); below 1 the selection "
                      "pays for itself in this layer. dsa: the eval's distilled indexer geometry (8 heads x 32) from "
                      "finished indexer tensors (the model's projections are not timed).", "",
                      "| selector | config | selector step ms | sparse attention ms | attended | overhead / saved | load |",
                      "|---|---|---|---|---:|---:|---:|"]
            for r in s["selectors"]:
                f = r["overhead_fraction_of_saved"]
                cfg_s = ", ".join(f"{k}={v}" for k, v in r["config"].items())
                lines.append(f"| {r['selector']} | {cfg_s} | {_ms(r['selector_step'])} | {_ms(r['sparse_attention'])} | "
                             f"{r['attended_fraction']:.3f} | {'n/a (no saving)' if f is None else f'{f:.2f}'} | "
                             f"{r['selector_step']['load_1m']} |")
            for name, why in s["skipped"].items():
                lines.append(f"| {name} | skipped: {why} | | | | | |")
    if "e2e" in res:
        lines += _provenance(res, "e2e") + e2e_report.render_markdown(res["e2e"])
    if "gpu" in res:
        lines += ["", "## GPU kernel scripts", ""]
        g = res["gpu"]
        if "skipped" in g:
            lines.append(f"Skipped: {g['skipped']}.")
        else:
            for name, v in g.items():
                lines.append(f"- `benchmarks/{name}.py`: {v['status']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (seconds); FlexAttention eager")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--out", default=DEFAULT_OUT,
                    help=f"folder for performance.json / performance.md (default {DEFAULT_OUT}/, gitignored)")
    ap.add_argument("--update-docs", action="store_true",
                    help="also rewrite the tracked docs/results/performance.json and docs/results/performance.md")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="run these sections only")
    ap.add_argument("--no-compile", action="store_true", help="FlexAttention eager only")
    ap.add_argument("--no-gpu", action="store_true", help="do not call the GPU kernel scripts")
    ap.add_argument("--e2e-lengths", type=int, nargs="+",
                    help="the e2e group's context lengths (default 4096 8192 16384 32768; --quick: tiny)")
    ap.add_argument("--e2e-baseline", metavar="PERFORMANCE_JSON",
                    help="an earlier run's performance.json (a path, or git:<rev>:<path>): the e2e section "
                         "shows its figures as 'before'")
    args = ap.parse_args(argv)
    command = " ".join(["python -m benchmarks", *(argv if argv is not None else sys.argv[1:])])
    res = run(args.quick, args.threads, tuple(args.only), not args.no_compile, not args.no_gpu, command,
              e2e_lengths=args.e2e_lengths, e2e_baseline=args.e2e_baseline)
    md = render_markdown(res)
    print(md)
    _write(Path(args.out), res, md)
    if args.update_docs:  # sections this run did not measure stay as the docs had them
        old_json = DOCS_DIR / "performance.json"
        docs = merge_into_docs(res, json.loads(old_json.read_text()) if old_json.is_file() else None)
        _write(DOCS_DIR, docs, render_markdown(docs))
    return res


def _write(out: Path, res: dict, md: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "performance.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "performance.md").write_text(md)
    print(f"wrote {out / 'performance.json'} and {out / 'performance.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
