"""Lossless sparse decoding in vLLM on CPU: vLLM's own attention without speculation against
kvsieve's drafter (a selector drafts ``K`` tokens, vLLM verifies them densely), decode tokens/s side
by side in one run, every speculative mode's greedy tokens checked against the baseline's.

    python benchmarks/vllm_lossless.py [--model smollm2] [--lengths 8000] [--concurrency 8]
                                       [--draft quest:budget=512,page_size=16] [--k 2,4,8]
                                       [--new 64] [--reps 2] [--sparse] [--dtype float32] [--out bench_out]

Runs in the vLLM virtual environment (docs/vllm.md, docs/lossless.md). One engine process per mode
and repetition, one at a time (8 x 8K requests in fp32 take a few GiB of KV space each), the modes
alternating within each repetition so that a change of the machine's load falls on all of them: ``own`` (vLLM's own
attention, no plug-in, no speculation: the baseline), ``<draft>@K`` for every ``--draft`` and ``--k``
(the launcher's lossless mode, :func:`kvsieve.eval.served.launch.split_speculation`: vLLM's
``speculative_config`` names kvsieve's drafter, the plug-in is configured with the draft selector) and, with ``--sparse``, the draft selector
serving every decode step (not lossless: its tokens are shown, not checked). Every engine answers the
same measurements in the same order: for each prompt length ``L`` and each concurrency ``C``: ``C``
requests, request ``i`` an essay cut to ``L`` tokens starting at essay ``i`` (distinct prompts),
greedy, ``ignore_eos``, ``--new`` tokens each. The prompts are first put in vLLM's prefix cache
(each once, one token generated; ``prefill_s``, untimed otherwise), then the measured requests are
added at once: they find their prompts cached and start decoding together.

``decode_tok_s``: the tokens produced in the engine steps in which all ``C`` requests are past
their prompt and none has finished, over those steps' time (the same definition for every mode; a
speculative step produces 1 to ``K + 1`` tokens per request); once the first request is done the
others are aborted (the token check compares the tokens both runs made). For the speculative modes also: the mean accepted
length (tokens per request per verify step, from vLLM's own spec-decode counters), acceptance by
draft position, the drafter's time per step (``SparseDrafter.propose``, timed in the engine process)
and the rest of the step (``verify_ms``: vLLM's dense pass over the ``K + 1`` rows, sampling,
scheduling), and the cost model ``A * own step / (draft + verify)`` (docs/lossless.md).

Token check (:func:`check_tokens`): every speculative mode's tokens must equal the baseline's; the
first difference of a request is allowed only where the baseline's two top logits (vLLM's raw logits,
``logprobs=2``) were a rounding tie (a verify pass over ``K + 1`` rows rounds differently from ``K + 1``
one-token steps): within ``--tie`` in fp32; in bf16, where vLLM's logits are bf16 values, within
``--tie`` or one bf16 step at the top logit (the two are neighbouring bf16 values, :func:`tie_tolerance`).
Any other difference makes the run exit with status 1.
Prints the CPU line, one JSON line per measurement with the load before and after, the table; writes
everything to ``--out/vllm_lossless-<UTC time>.json``, again after every measurement (a run stopped
early keeps its finished measurements and their table). Compare ratios, not figures across runs.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the benchmarks package

from benchmarks._timing import cpu_isa  # noqa: E402
from kvsieve.eval.served.launch import OWN, EngineLaunch, EngineProcess, model_folder, split_speculation  # noqa: E402
from kvsieve.eval.served.worker import spec_counters, spec_delta  # noqa: E402

TIE = 1e-3  # the transformers half's rounding rule (kvsieve.integrations.transformers.speculate.TIE_TOLERANCE)

class ProposeTimer:
    """Seconds spent in the drafter's ``propose`` since the last :meth:`take` (wraps the class's method)."""

    def __init__(self, cls: type) -> None:
        self.seconds = 0.0
        inner = cls.propose

        def timed(drafter: Any, *a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(drafter, *a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0

        cls.propose = timed

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def spec_summary(delta: dict[str, Any]) -> dict[str, Any]:
    """Mean accepted length and acceptance by draft position from the spec-decode counters' increase
    over a measurement (:func:`kvsieve.eval.served.worker.spec_delta`)."""
    drafts = delta["drafts"]
    if drafts <= 0:
        return {"drafts": 0}
    return {"drafts": int(drafts), "mean_accepted_length": round(1 + delta["accepted"] / drafts, 3),
            "acceptance_by_position": [round(a / drafts, 3) for a in delta["per_position"]]}


def worker(args: argparse.Namespace) -> None:
    """One engine; answers each ``go REP L C`` line on stdin with one ``RESULT {json}`` line."""
    from vllm import LLM, SamplingParams, TokensPrompt

    from kvsieve.eval.haystack import essay_haystack

    own, k = args.mode == OWN, split_speculation(args.mode)[1]
    timer = None
    if k is not None:
        from kvsieve.integrations.vllm.drafter import SparseDrafter
        timer = ProposeTimer(SparseDrafter)
    conc, longest = max(args.concurrency), max(args.lengths)
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=longest + args.new + 64, enforce_eager=True,
              max_num_seqs=conc, max_num_batched_tokens=2048, block_size=args.block_size, seed=0,
              distributed_executor_backend="uni", enable_prefix_caching=True, disable_log_stats=False,
              **({"logprobs_mode": "raw_logits"} if own else {}),  # the baseline's top two logits, as computed
              speculative_config=EngineLaunch(args.mode).speculative_config())
    tok = llm.get_tokenizer()
    prompts = {n: [tok.encode(essay_haystack(tok, n + 64, start=i), add_special_tokens=False)[:n] for i in range(conc)]
               for n in args.lengths}
    engine = llm.llm_engine
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] != "go":
            break
        rep, n, c = (int(x) for x in cmd[1:4])
        params = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True, logprobs=2 if own else None)
        t0 = time.perf_counter()  # the prompts into the prefix cache, untimed: the timed requests start decoding together
        for i in range(c):
            engine.add_request(f"w{rep}-{n}-{c}-{i}", TokensPrompt(prompt_token_ids=prompts[n][i]),
                               SamplingParams(temperature=0.0, max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
        prefill_s = time.perf_counter() - t0
        before = spec_counters(llm) if k is not None else None
        for i in range(c):
            engine.add_request(f"r{rep}-{n}-{c}-{i}", TokensPrompt(prompt_token_ids=prompts[n][i]), params)
        counts: dict[str, int] = {}
        latest: dict[str, list[int]] = {}
        logprobs: dict[str, Any] = {}
        steady_tokens, steady_s, steady_draft_s, steady_steps = 0, 0.0, 0.0, 0
        finished = False
        if timer is not None:
            timer.take()
        while engine.has_unfinished_requests():
            steady = len(counts) == c and min(counts.values()) > 0
            s0 = time.perf_counter()
            outs = engine.step()
            s1 = time.perf_counter()
            drafted = timer.take() if timer is not None else 0.0
            new = 0
            for out in outs:
                latest[out.request_id] = list(out.outputs[0].token_ids)
                if own:
                    logprobs[out.request_id] = out.outputs[0].logprobs
                new += len(latest[out.request_id]) - counts.get(out.request_id, 0)
                counts[out.request_id] = len(latest[out.request_id])
                finished = finished or out.finished
            if finished:  # the steady window ends with the first request done; the rest are not timed
                engine.abort_request([r for r in counts if r not in {o.request_id for o in outs if o.finished}])
                break
            if steady:
                steady_tokens, steady_s, steady_draft_s, steady_steps = (
                    steady_tokens + new, steady_s + s1 - s0, steady_draft_s + drafted, steady_steps + 1)
        if steady_steps < 2:
            raise RuntimeError(f"only {steady_steps} steps with all {c} requests decoding; raise --new")
        order = sorted(latest, key=lambda r: int(r.rsplit("-", 1)[1]))
        row = {"rep": rep, "prompt_tokens": n, "concurrency": c, "prefill_s": round(prefill_s, 3),
               "steady_steps": steady_steps, "step_ms": round(1e3 * steady_s / steady_steps, 2),
               "decode_tok_s": round(steady_tokens / steady_s, 3),
               "tokens": [latest[r] for r in order]}
        if own:
            row["top2_logits"] = [[_top2(lp) for lp in logprobs[r]] for r in order]
        if k is not None:
            row.update(draft_ms=round(1e3 * steady_draft_s / steady_steps, 2),
                       verify_ms=round(1e3 * (steady_s - steady_draft_s) / steady_steps, 2),
                       **spec_summary(spec_delta(before, spec_counters(llm))))
        print("RESULT " + json.dumps(row), flush=True)


def _top2(logits: dict[int, Any]) -> list[float]:
    """The two highest logits at one position (the second ``-inf`` when there is only one)."""
    top = sorted((lp.logprob for lp in logits.values()), reverse=True)
    return [top[0], top[1] if len(top) > 1 else -math.inf]


def tie_tolerance(top: float, dtype: str, tie: float = TIE) -> float:
    """The largest gap between the two top logits that counts as a rounding tie: ``tie`` in fp32; in
    bf16 also one bf16 step at ``top`` (``2 ** (floor(log2 |top|) - 7)``: 8 significant bits), so two
    neighbouring bf16 logits are a tie and anything further apart is not. Another dtype: ``ValueError``
    naming it (its rounding rule is not written)."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"token check: no rounding-tie rule for dtype {dtype!r}; known: float32, bfloat16")
    if dtype == "float32" or top == 0 or not math.isfinite(top):
        return tie
    return max(tie, 2.0 ** (math.floor(math.log2(abs(top))) - 7))


def check_tokens(base: dict[str, Any], row: dict[str, Any], tie: float = TIE, dtype: str = "float32") -> list[str]:
    """What differs between a mode's tokens and the baseline's (empty: identical, or every first
    difference at a rounding tie of the baseline's top two logits, :func:`tie_tolerance`)."""
    problems = []
    for i, (want, got) in enumerate(zip(base["tokens"], row["tokens"], strict=True)):
        diff = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), None)
        if diff is None:
            continue
        top, second = base["top2_logits"][i][diff]
        gap, allowed = top - second, tie_tolerance(top, dtype, tie)
        if gap > allowed:
            problems.append(f"request {i}, token {diff}: {got[diff]} against the baseline's {want[diff]}, whose two "
                            f"top logits are {top:.5g} and {second:.5g}, {gap:.3g} apart (> {allowed:.3g} in "
                            f"{dtype}: not a rounding tie)")
    return problems


def ties(base: dict[str, Any], row: dict[str, Any]) -> int:
    """Requests whose tokens differ from the baseline's (each at a tie, once :func:`check_tokens` passed)."""
    return sum(a[:len(b)] != b[:len(a)] for a, b in zip(base["tokens"], row["tokens"]))


def table(rows: list[dict[str, Any]], tie: float = TIE, dtype: str = "float32") -> list[dict[str, Any]]:
    """Per (prompt length, concurrency, mode): medians over repetitions, the ratio to ``own`` in the
    same repetition, the cost model and the token check (``tie``, ``dtype``: :func:`check_tokens`)."""
    out = []
    keys = sorted({(r["prompt_tokens"], r["concurrency"]) for r in rows})
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    for n, c in keys:
        base = {r["rep"]: r for r in rows if r["mode"] == OWN and (r["prompt_tokens"], r["concurrency"]) == (n, c)}
        for mode in modes:
            mine = [r for r in rows if r["mode"] == mode and (r["prompt_tokens"], r["concurrency"]) == (n, c)]
            if not mine or not base:
                continue
            entry: dict[str, Any] = {"prompt_tokens": n, "concurrency": c, "mode": mode,
                                     "decode_tok_s": statistics.median(r["decode_tok_s"] for r in mine),
                                     "x_own": round(statistics.median(r["decode_tok_s"] / base[r["rep"]]["decode_tok_s"]
                                                                      for r in mine), 3),
                                     "step_ms": statistics.median(r["step_ms"] for r in mine)}
            if "mean_accepted_length" in mine[0]:
                a = statistics.median(r["mean_accepted_length"] for r in mine)
                draft_ms = statistics.median(r["draft_ms"] for r in mine)
                verify_ms = statistics.median(r["verify_ms"] for r in mine)
                own_ms = statistics.median(b["step_ms"] for b in base.values())
                entry.update(mean_accepted_length=a, draft_ms=draft_ms, verify_ms=verify_ms,
                             cost_model=round(a * own_ms / (draft_ms + verify_ms), 3),
                             acceptance_by_position=mine[0]["acceptance_by_position"])
            if mode != OWN:
                checked = split_speculation(mode)[1] is not None
                problems = [p for r in mine for p in check_tokens(base[r["rep"]], r, tie, dtype)] if checked else []
                differ = sum(ties(base[r["rep"]], r) for r in mine)
                entry["tokens"] = ("MISMATCH: " + "; ".join(problems) if problems else
                                   ("own's" if differ == 0 else f"own's ({differ} requests differ at a rounding tie)")
                                   if checked else f"{differ} of {sum(len(r['tokens']) for r in mine)} requests differ "
                                   "(not lossless)")
            out.append(entry)
    return out


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, gemma3-270m or a checkpoint folder")
    ap.add_argument("--lengths", default="8000", help="comma-separated prompt lengths (tokens)")
    ap.add_argument("--concurrency", default="8", help="comma-separated numbers of concurrent requests")
    ap.add_argument("--draft", action="append", help="a KVSIEVE_SELECTOR string drafting (repeatable; default "
                    "quest:budget=512,page_size=16, 1/16 of 8K)")
    ap.add_argument("--k", default="2,4,8", help="comma-separated draft lengths (num_speculative_tokens)")
    ap.add_argument("--new", type=int, default=64, help="tokens generated per request beyond the prefill's stagger")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--sparse", action="store_true", help="also each draft selector on every decode step (not lossless)")
    ap.add_argument("--block-size", type=int, default=128, help="vLLM's KV block size (a multiple of 32 on CPU)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2, help="OpenMP threads per engine, unbound")
    ap.add_argument("--kv-gib", type=int, default=8, help="vLLM's CPU KV space per engine (GiB)")
    ap.add_argument("--tie", type=float, default=TIE, help="the rounding-tie tolerance of the token check")
    ap.add_argument("--out", default="bench_out", help="folder of the JSON result")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # internal: one engine process
    ap.add_argument("--mode", help=argparse.SUPPRESS)  # internal: the worker's mode
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.lengths = [int(x) for x in str(args.lengths).split(",")]
    args.concurrency = [int(x) for x in str(args.concurrency).split(",")]
    ks = [int(x) for x in str(args.k).split(",")]
    if args.worker:
        worker(args)
        return 0
    drafts = args.draft or ["quest:budget=512,page_size=16"]
    args.model = str(model_folder(args.model))
    modes = [OWN] + [f"{d}@{k}" for d in drafts for k in ks] + ([*drafts] if args.sparse else [])
    isa = cpu_isa()
    print(f"CPU {isa}", flush=True)
    started = datetime.now(timezone.utc)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    path = out / f"vllm_lossless-{started.strftime('%Y%m%dT%H%M%SZ')}.json"

    def save() -> list[dict[str, Any]]:  # after every measurement: a run stopped early keeps what it measured
        result = table(rows, args.tie, args.dtype)
        path.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "worker"}, "cpu": isa,
                                    "started_utc": started.isoformat(timespec="seconds"),
                                    "finished_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                    "rows": rows, "table": result}, indent=1))
        return result
    for rep in range(args.reps):  # the modes alternate within each repetition, one engine at a time (each
        for mode in modes:        # holds the KV of every concurrent request): a change of load falls on all
            launch = EngineLaunch(mode, threads=args.threads, kv_cache_gib=args.kv_gib)
            cmd = [sys.executable, __file__, "--worker", "--mode", mode, "--model", args.model,
                   "--lengths", ",".join(map(str, args.lengths)), "--concurrency", ",".join(map(str, args.concurrency)),
                   "--new", str(args.new), "--block-size", str(args.block_size), "--dtype", args.dtype]
            log = out / f"engine-{started.strftime('%H%M%S')}-{rep}-{modes.index(mode)}.log"
            with EngineProcess(mode, cmd, launch.env(), log) as proc:
                for n in args.lengths:
                    for c in args.concurrency:
                        before = _load()
                        proc.send(f"go {rep} {n} {c}")
                        row = {"mode": mode, **json.loads(proc.read("RESULT ")), "load_before": before,
                               "load_after": _load()}
                        print(json.dumps({k: v for k, v in row.items() if k not in ("tokens", "top2_logits")}),
                              flush=True)
                        rows.append(row)
                        save()
    result = save()
    for entry in result:
        print(json.dumps(entry))
    print(f"\nwritten: {path}")
    bad = [e for e in result if str(e.get("tokens", "")).startswith("MISMATCH")]
    for e in bad:
        print(f"TOKENS DIFFER: {e['mode']} at {e['prompt_tokens']} x {e['concurrency']}: {e['tokens']}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
