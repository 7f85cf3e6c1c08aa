"""The e2e section's report: the issue's targets from one run's ratios, its Markdown, and the
"before" of a before-and-after comparison (an earlier run's JSON).

The ratios themselves are computed by :func:`benchmarks.e2e.run`; nothing here times anything.
"""
from __future__ import annotations

__all__ = ["DENSE", "DENSE_MIN_RATIO", "FLOOR_MIN_FRACTION", "PLAIN", "baseline_from", "render_markdown", "targets"]

DENSE_MIN_RATIO = 0.95  # issue #17 target 1: kvsieve dense >= 0.95x plain transformers at every length
FLOOR_MIN_FRACTION = 0.5  # a practical selector at 1/16 reaches >= 50% of the floor's tokens/s at 32K
PLAIN, DENSE = "plain", "kvsieve_dense"


def targets(res: dict) -> list[dict]:
    """Issue #17 target 1 from one run's side-by-side ratios (``met`` is ``None`` where the run did
    not measure the length the target names)."""
    cfg, rows = res["config"], {r["length"]: r for r in res["rows"] if r["length"] != res["config"]["floor_length"]}
    out = []
    if rows:
        worst = min(rows.values(), key=lambda r: r["vs_plain"][DENSE])
        out.append({"target": f"kvsieve dense >= {DENSE_MIN_RATIO}x plain transformers at every length "
                              f"(worst: {worst['length']} tokens)",
                    "value": worst["vs_plain"][DENSE], "met": worst["vs_plain"][DENSE] >= DENSE_MIN_RATIO})
    for s in cfg["selectors"]:
        long = rows.get(32768)
        out.append({"target": f"{s} at 1/{cfg['reduction_factor']} >= {FLOOR_MIN_FRACTION:.0%} of the floor's "
                              "tokens/s at 32K (fraction of the floor)",
                    "value": None if long is None else long["vs_floor"][s],
                    "met": None if long is None else long["vs_floor"][s] >= FLOOR_MIN_FRACTION})
        short = rows.get(4096)
        out.append({"target": f"{s} at 1/{cfg['reduction_factor']} never slower than kvsieve dense at 4K (ratio)",
                    "value": None if short is None else short["vs_dense"][s],
                    "met": None if short is None else short["vs_dense"][s] >= 1.0})
    return out


def render_markdown(res: dict) -> list[str]:
    """The e2e section's Markdown lines (a heading, the ratio table and the per-layer profile)."""
    cfg = res["config"]
    names = [*cfg["selectors"], DENSE, PLAIN]
    lines = ["", f"## End to end: greedy decode through the transformers integration ({res['model_name']})", "",
             f"{res['num_layers']} layers, backend `{cfg['backend']}`, one request, {cfg['steps']} timed greedy steps "
             f"after {cfg['warmup']} warm-up per configuration; selectors at budget = length / {cfg['reduction_factor']} "
             f"(page {cfg['page_size']}; native CPU kernels: "
             + ", ".join(f"{k} {v}" for k, v in res["native_kernels"].items()) + f"). One prefill of {res['prefill']['length']} random tokens "
             f"({res['prefill']['seconds']:.0f} s)" + (f", its blocks repeated up to {res['prefill']['tiled_to']} tokens "
             "(longer contexts are not prefilled: speed only)" if res['prefill']['tiled_to'] > res['prefill']['length']
             else "") + ", rewound to each length; configurations timed interleaved, a step "
             "of each in turn, each from the same state (plain transformers decodes from a `DynamicCache` holding the "
             "same K/V). Peak RSS: the process's high-water mark while that length ran (kvsieve's pool is sized "
             "for the longest length). Floor: plain transformers at "
             f"{cfg['floor_length']} tokens, {res['floor_tokens_per_s']:.2f} tokens/s. Load average (1, 5, 15 min) "
             f"{'/'.join(f'{x:.2f}' for x in res['loadavg_start'])} at start, "
             f"{'/'.join(f'{x:.2f}' for x in res['loadavg_end'])} at the end.", "",
             "| length | " + " | ".join(f"{n} tok/s" for n in names) + " | dense / plain | "
             + " | ".join(f"{s} / plain | {s} / floor | {s} / dense" for s in cfg["selectors"])
             + " | peak RSS MiB | load |",
             "|---:|" + "---:|" * (len(names) + 1 + 3 * len(cfg["selectors"]) + 2)]
    for r in res["rows"]:
        t = r["tokens_per_s"]
        sel = " | ".join(f"{r['vs_plain'][s]:.2f}x | {r['vs_floor'][s]:.0%} | {r['vs_dense'][s]:.2f}x"
                         for s in cfg["selectors"])
        lines.append(f"| {r['length']} | " + " | ".join(f"{t[n]:.2f}" for n in names)
                     + f" | {r['vs_plain'][DENSE]:.2f}x | " + (sel + " | " if sel else "")
                     + f"{r['peak_rss_mb']:.0f} | {r['load_1m_start']:.1f}-{r['load_1m_end']:.1f} |")
    longest = max(res["rows"], key=lambda r: r["length"])
    if longest["profile"]:
        from .e2e_profile import render_profile

        lines += ["", f"### Per-layer profile at {longest['length']} tokens (ms per decode step)", ""]
        lines += render_profile(longest["profile"], res["num_layers"])
    if "baseline" in res:
        lines += _render_baseline(res, longest)
    return lines


def baseline_from(perf: dict, source: str) -> dict:
    """The "before" of an e2e section: from ``perf`` (the JSON ``python -m benchmarks`` wrote for
    an earlier run; ``source`` says where it came from) its run's date and command, its tokens/s
    per length and its profile at its longest length. Raises ``ValueError`` when it has no e2e
    section with a profile."""
    e = perf.get("e2e")
    if not e or not e.get("rows"):
        raise ValueError(f"e2e baseline {source}: no e2e section (run `python -m benchmarks --only e2e` for one)")
    longest = max(e["rows"], key=lambda r: r["length"])
    if not longest.get("profile"):
        raise ValueError(f"e2e baseline {source}: its e2e section has no per-layer profile (run without --no-profile)")
    meta = perf.get("earlier", {}).get("e2e", perf["meta"])
    return {"source": source, "date": meta["date"], "command": meta.get("command", "(command not recorded)"),
            "length": longest["length"], "profile": longest["profile"],
            "tokens_per_s": {str(r["length"]): r["tokens_per_s"] for r in e["rows"]}}


def _render_baseline(res: dict, longest: dict) -> list[str]:
    """Before (the baseline run) and after (this run): tokens/s per length both ran, and the
    profile at the longest length when both profiled it."""
    base = res["baseline"]
    ours = (*res["config"]["selectors"], DENSE, PLAIN)
    names = [n for n in ours if n in next(iter(base["tokens_per_s"].values()))]
    lines = ["", f"### Before and after: this run against the run of {base['date']} (`{base['command']}`, "
                 f"from {base['source']})", ""]
    # what the baseline cannot be compared on is said, not dropped
    missing = [n for n in ours if n not in names]
    unmatched = [r["length"] for r in res["rows"] if str(r["length"]) not in base["tokens_per_s"]]
    if missing:
        lines += [f"Not in the baseline, so shown after only (above): {', '.join(missing)}.", ""]
    if unmatched:
        lines += [f"Lengths the baseline did not run: {', '.join(map(str, unmatched))}.", ""]
    lines += ["| length | " + " | ".join(f"{n} tok/s before -> after" for n in names) + " |",
              "|---:|" + "---:|" * len(names)]
    for r in res["rows"]:
        before = base["tokens_per_s"].get(str(r["length"]))
        if before is not None:
            lines.append(f"| {r['length']} | " + " | ".join(f"{before[n]:.2f} -> {r['tokens_per_s'][n]:.2f}"
                                                           for n in names) + " |")
    if not longest["profile"]:
        return lines
    if base["length"] != longest["length"]:
        return lines + ["", f"No profile comparison: the baseline profiled {base['length']} tokens, this run "
                            f"{longest['length']}."]
    from .e2e_profile import STAGES

    lines += ["", f"Per-layer profile at {base['length']} tokens, ms per decode step before -> after:", "",
              "| stage | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for stage in (*STAGES, "step"):
        lines.append(f"| {stage} | " + " | ".join(
            f"{base['profile'][n][stage]:.2f} -> {longest['profile'][n][stage]:.2f}" for n in names) + " |")
    return lines
