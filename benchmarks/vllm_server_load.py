"""vLLM's OpenAI-compatible server with the kvsieve plug-in under concurrent clients (issue 43 item 2):
no crash, no request changing another's output, bad per-request settings refused alone, and the
server's resident memory flat over the run.

    python benchmarks/vllm_server_load.py [--model smollm2] [--requests 1000] [--clients 32]
        [--selector quest:budget=64,page_size=16] [--warmup 200] [--max-tokens 8] [--out bench_out]

Runs in the vLLM virtual environment (docs/vllm.md). The server listens on 127.0.0.1 only (fp32,
``--max-model-len 1024``, 8 sequences at once, one OpenMP thread, prefix caching on). First every
(prompt, setting) pair of the workload is sent once, one request at a time: the references. Then
``--requests`` requests go out from ``--clients`` client threads at once (the stdlib's urllib; the
kinds drawn with a fixed seed, :data:`KINDS`):

* ``complete`` / ``stream``: a greedy completion (``ignore_eos``), non-streaming or streaming
  (server-sent events), one of :data:`PROMPTS` with one of :data:`SETTINGS`
  (``"vllm_xargs": {"kvsieve": "budget=32"}``); its text must equal the reference of its pair;
* ``cancel``: a streaming completion the client closes after its first chunk (the server aborts it);
* ``bad_setting``: a per-request setting the process's selector cannot honour (:data:`BAD_SETTINGS`);
  it must be refused (HTTP 400) with a message naming the field, and nothing else may change;
* ``malformed``: a body vLLM must refuse (not JSON, no prompt, a negative ``max_tokens``, a
  temperature that is not a number): any 4xx;
* ``overlong``: a prompt longer than the model length: 400.

Every request has a timeout, the run a deadline (``--deadline-s``). The sum of the resident memory
(``VmRSS``) of the server process and its descendants (the engine core, the worker) is sampled
every ``--sample-every`` finished requests; growth = (median of the last three samples) / (median
of the samples in the 100 requests after ``--warmup``) - 1, with each process's growth in MiB
beside it, and the same for ``RssAnon`` (anonymous memory only: what a leak grows; ``VmRSS`` also
moves as the kernel drops and reads back the memory-mapped weights).
``--selector own`` runs the same load on vLLM's own attention without the plug-in (valid requests
carry no setting; bad settings must be refused as "plug-in is not enabled"), for comparison. The benchmark prints the summary and a
markdown table, writes them to ``--out/vllm_server_load-<UTC time>.json`` and exits 1 when a
request was lost, crashed the server or differs from its reference, a refusal does not name its
field, or memory grew by more than ``--max-growth`` (5%).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the benchmarks package

from benchmarks._timing import cpu_isa, load_averages  # noqa: E402
from benchmarks.vllm_client import completion_response, error_message, sse_chunks  # noqa: E402
from benchmarks.vllm_common import FILLER  # noqa: E402
from kvsieve.eval.served.launch import OWN, EngineLaunch, default_threads, healthy, model_folder, openai_server  # noqa: E402,E501

#: prompts of different lengths and distinct first blocks (about 20 to 400 tokens)
PROMPTS = [f"Letter {i}. " + FILLER * n + "The price of grain was" for i, n in enumerate((0, 2, 5, 9, 14, 19))]
#: per-request settings of the valid requests (``None``: the process default)
SETTINGS = [None, "budget=32", "budget=128", "dense=true"]
#: bad per-request settings and the field each refusal must name
BAD_SETTINGS = {"page_size=32": "page_size", "budget=8": "budget", "index_topk=64": "index_topk",
                "budget=abc": "budget", "sparsity=0.5": "sparsity"}
#: request kinds and their weights
KINDS = {"complete": 35, "stream": 30, "cancel": 10, "bad_setting": 10, "malformed": 10, "overlong": 5}
MAX_MODEL_LEN = 1024
OVERLONG = FILLER * 60  # about 1,800 tokens
START_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 300


@dataclass(frozen=True)
class Request:
    """One client request: its ``kind`` (:data:`KINDS`), prompt index, per-request setting (a string
    in ``KVSIEVE_SELECTOR``'s field syntax, ``None`` = none) and, for ``malformed``, the variant."""

    index: int
    kind: str
    prompt: int = 0
    setting: str | None = None
    variant: int = 0


@dataclass
class Outcome:
    """What came back: HTTP ``status`` (0: no response), the completion ``text`` (streamed chunks
    joined), the error ``message`` of a refusal, whether the client cancelled, seconds taken."""

    request: Request
    status: int = 0
    text: str = ""
    message: str = ""
    cancelled: bool = False
    seconds: float = 0.0


def plan(num_requests: int, seed: int = 0, settings: list[str | None] = SETTINGS) -> list[Request]:
    """``num_requests`` requests of kinds drawn by :data:`KINDS`'s weights (fixed ``seed``), at least
    one of each kind when there are as many requests as kinds; valid requests take one of ``settings``."""
    rng = random.Random(seed)
    kinds = list(KINDS) + rng.choices(list(KINDS), weights=list(KINDS.values()), k=max(0, num_requests - len(KINDS)))
    kinds = kinds[:num_requests]
    rng.shuffle(kinds)
    bad = list(BAD_SETTINGS)
    return [Request(i, k, prompt=rng.randrange(len(PROMPTS)),
                    setting=rng.choice(bad) if k == "bad_setting" else rng.choice(settings), variant=rng.randrange(4))
            for i, k in enumerate(kinds)]


def _body(req: Request, max_tokens: int) -> dict:
    body = {"model": "served", "prompt": PROMPTS[req.prompt], "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}
    if req.setting is not None:
        body["vllm_xargs"] = {"kvsieve": req.setting}
    if req.kind in ("stream", "cancel"):
        body["stream"] = True
    if req.kind == "cancel":
        body["max_tokens"] = 4 * max_tokens
    if req.kind == "overlong":
        body["prompt"] = OVERLONG
    return body


def _malformed(req: Request, max_tokens: int) -> bytes:
    body = _body(req, max_tokens)
    if req.variant == 0:
        return b'{"model": "served", "prompt": "unterminated'
    if req.variant == 1:
        del body["prompt"]
    elif req.variant == 2:
        body["max_tokens"] = -5
    else:
        body["temperature"] = "hot"
    return json.dumps(body).encode()


def send(host: str, port: int, req: Request, max_tokens: int, timeout: float = REQUEST_TIMEOUT_S) -> Outcome:
    """Send one request on its own connection and read the answer (a streaming one chunk by chunk;
    ``cancel`` closes the connection after the first chunk with text)."""
    out, t0 = Outcome(req), time.monotonic()
    payload = _malformed(req, max_tokens) if req.kind == "malformed" else json.dumps(_body(req, max_tokens)).encode()
    try:
        with completion_response(port, payload, timeout_s=timeout, host=host) as resp:
            out.status = resp.status
            if resp.status != 200:
                out.message = error_message(resp.read())
            elif req.kind in ("stream", "cancel"):
                parts = []
                for chunk in sse_chunks(resp):
                    parts.append("".join(c.get("text", "") for c in chunk.get("choices", [])))
                    if req.kind == "cancel" and parts[-1]:
                        out.cancelled = True
                        break
                out.text = "".join(parts)
            else:
                out.text = json.loads(resp.read())["choices"][0]["text"]
    except (OSError, http.client.HTTPException) as e:
        out.message = f"{type(e).__name__}: {e}"
    finally:
        out.seconds = time.monotonic() - t0
    return out


def tree_rss_bytes(pid: int) -> dict[str, tuple[int, int]]:
    """The resident memory of process ``pid`` and each of its descendants, by ``"<pid> <name>"`` (the
    server's API process, its engine core, its worker): ``(VmRSS, RssAnon)`` in bytes. ``RssAnon``
    leaves out file-backed pages (the model's memory-mapped weights, libraries), which the kernel
    drops and reads back as other processes need the page cache."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = {}, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            status = dict(line.split(":", 1) for line in Path(f"/proc/{p}/status").read_text().splitlines())
        except OSError:
            continue
        found[f"{p} {status['Name'].strip()}"] = tuple(int(status.get(k, "0 kB").split()[0]) * 1024
                                                       for k in ("VmRSS", "RssAnon"))
    return found


def served(model: str, selector: str | None, log: Path, *, max_num_seqs: int = 8
           ) -> AbstractContextManager[tuple[int, subprocess.Popen]]:
    """vLLM's OpenAI-compatible server on 127.0.0.1 (:func:`kvsieve.eval.served.launch.openai_server`)
    with ``KVSIEVE_SELECTOR=selector`` (``None``: without the plug-in, vLLM's own attention), fp32,
    :data:`MAX_MODEL_LEN`, 1 GiB of KV space, ``OMP_NUM_THREADS`` (default 1) unbound threads, ready
    within :data:`START_TIMEOUT_S`; yields ``(port, process)`` and stops the server's process group after."""
    launch = EngineLaunch(selector or OWN, threads=default_threads(), kv_cache_gib=1)
    return openai_server(launch, model, log, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=max_num_seqs,
                         start_timeout_s=START_TIMEOUT_S)


def references(port: int, max_tokens: int, settings: list[str | None] = SETTINGS) -> dict[tuple[int, str | None], str]:
    """Every (prompt, setting) pair's greedy text, one request at a time (non-streaming)."""
    refs = {}
    for p in range(len(PROMPTS)):
        for s in settings:
            out = send("127.0.0.1", port, Request(-1, "complete", p, s), max_tokens)
            if out.status != 200:
                raise RuntimeError(f"reference of prompt {p} with setting {s!r} failed: {out.status} {out.message}")
            refs[(p, s)] = out.text
    return refs


@dataclass
class LoadRun:
    """Outcomes of a load run and the memory samples ``(finished requests, seconds,
    :func:`tree_rss_bytes`)``."""

    outcomes: list[Outcome] = field(default_factory=list)
    rss: list[tuple[int, float, dict[str, tuple[int, int]]]] = field(default_factory=list)


def run_load(port: int, server_pid: int, requests: list[Request], *, clients: int, max_tokens: int,
             sample_every: int, deadline_s: float) -> LoadRun:
    """Send ``requests`` from ``clients`` threads at once; sample the server tree's RSS every
    ``sample_every`` finished requests (and before the first). Raises when the run passes
    ``deadline_s`` (clients stop taking new requests)."""
    run, lock, t0 = LoadRun(), threading.Lock(), time.monotonic()
    run.rss.append((0, 0.0, tree_rss_bytes(server_pid)))

    def one(req: Request) -> None:
        if time.monotonic() - t0 > deadline_s:
            return
        out = send("127.0.0.1", port, req, max_tokens)
        with lock:
            run.outcomes.append(out)
            done = len(run.outcomes)
            if done % sample_every == 0 or done == len(requests):
                run.rss.append((done, round(time.monotonic() - t0, 1), tree_rss_bytes(server_pid)))

    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(one, requests))
    if len(run.outcomes) != len(requests):
        raise RuntimeError(f"deadline of {deadline_s} s passed after {len(run.outcomes)} of {len(requests)} requests")
    return run


def judge(run: LoadRun, refs: dict[tuple[int, str | None], str], plugin: bool = True) -> dict:
    """Counts per outcome and every problem: a valid request that failed or differs from its reference,
    a refusal that does not name its field (without the plug-in: that it is not enabled) or a bad
    request served, a malformed or over-long one not refused with a 4xx, a cancelled stream that
    never started."""
    problems, counts = [], dict.fromkeys(("served", "refused_setting", "refused_malformed", "refused_overlong",
                                          "cancelled"), 0)
    mismatches = 0
    for o in run.outcomes:
        r = o.request
        if r.kind in ("complete", "stream"):
            if o.status != 200:
                problems.append(f"request {r.index} ({r.kind}) failed: {o.status} {o.message[:200]}")
            elif o.text != refs[(r.prompt, r.setting)]:
                mismatches += 1
                problems.append(f"request {r.index} ({r.kind}, prompt {r.prompt}, setting {r.setting!r}) differs "
                                f"from its reference: {o.text!r} vs {refs[(r.prompt, r.setting)]!r}")
            else:
                counts["served"] += 1
        elif r.kind == "cancel":
            if o.status == 200 and o.cancelled:
                counts["cancelled"] += 1
            else:
                problems.append(f"request {r.index} (cancel) did not stream: {o.status} {o.message[:200]}")
        elif r.kind == "bad_setting":
            named = f"'{BAD_SETTINGS[r.setting]}'" in o.message if plugin else "plug-in is not enabled" in o.message
            if o.status == 400 and named:
                counts["refused_setting"] += 1
            else:
                problems.append(f"request {r.index} (setting {r.setting!r}) not refused naming its field: "
                                f"{o.status} {o.message[:300]}")
        elif 400 <= o.status < 500:
            counts["refused_overlong" if r.kind == "overlong" else "refused_malformed"] += 1
        else:
            problems.append(f"request {r.index} ({r.kind}, variant {r.variant}) not refused: {o.status} "
                            f"{o.message[:200]}")
    return {"requests": len(run.outcomes), **counts, "mismatches": mismatches, "problems": problems}


def rss_growth(rss: list[tuple[int, float, dict[str, tuple[int, int]]]], warmup: int) -> dict:
    """Of the summed ``VmRSS`` (and beside it ``RssAnon``): baseline, the median of the samples taken
    in the 100 requests after ``warmup`` finished ones; final, the median of the last three samples;
    growth = final / baseline - 1; and each process's growth in MiB from the first sample at or past
    ``warmup`` to the last."""
    if len(rss) < 3 or rss[-1][0] <= warmup + 100:
        raise ValueError(f"memory growth needs samples past warm-up + 100 = {warmup + 100} requests; "
                         f"the run has {rss[-1][0]}")
    after = next(b for n, _, b in rss if n >= warmup)
    out: dict = {"warmup": warmup}
    for i, kind in enumerate(("rss", "anon")):
        total = [(n, sum(v[i] for v in b.values())) for n, _, b in rss]
        baseline = statistics.median(b for n, b in total if warmup <= n <= warmup + 100)
        final = statistics.median(b for _, b in total[-3:])
        out[kind] = {"baseline_mib": round(baseline / 2**20, 1), "final_mib": round(final / 2**20, 1),
                     "max_mib": round(max(b for _, b in total) / 2**20, 1),
                     "growth_pct": round(100 * (final / baseline - 1), 2),
                     "growth_mib_by_process": {name: round((rss[-1][2].get(name, (0, 0))[i] - v[i]) / 2**20, 1)
                                               for name, v in after.items()}}
    out["growth_pct"] = out["rss"]["growth_pct"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--selector", default="quest:budget=64,page_size=16",
                    help="KVSIEVE_SELECTOR of the server, or 'own' (no plug-in: vLLM's own attention, no settings)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--sample-every", type=int, default=25)
    ap.add_argument("--max-growth", type=float, default=5.0, help="percent")
    ap.add_argument("--deadline-s", type=float, default=3 * 3600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    print(f"CPU: {cpu_isa()}; load average before: {load_averages()}", flush=True)
    plugin = args.selector != "own"
    settings = SETTINGS if plugin else [None]
    with served(str(model_folder(args.model)), args.selector if plugin else None,
                out_dir / f"vllm_server_load-{stamp}.log") as (port, proc):
        t0 = time.monotonic()
        refs = references(port, args.max_tokens, settings)
        print(f"{len(refs)} references in {time.monotonic() - t0:.0f} s", flush=True)
        run = run_load(port, proc.pid, plan(args.requests, args.seed, settings), clients=args.clients,
                       max_tokens=args.max_tokens, sample_every=args.sample_every, deadline_s=args.deadline_s)
        alive = healthy(port) and send("127.0.0.1", port, Request(-1, "complete", 0, None), args.max_tokens).text \
            == refs[(0, None)]
    summary = judge(run, refs, plugin)
    memory = rss_growth(run.rss, args.warmup)
    result = {"args": vars(args), "date": stamp, "cpu": cpu_isa(), "load_average_after": load_averages(),
              "wall_s": round(time.monotonic() - t0, 1), "server_alive_after": alive, **summary, "memory": memory,
              "rss_samples": [(n, s, {k: [round(x / 2**20, 1) for x in v] for k, v in b.items()}) for n, s, b in run.rss],
              "kinds": {k: sum(o.request.kind == k for o in run.outcomes) for k in KINDS},
              "seconds_median": {k: round(statistics.median([o.seconds for o in run.outcomes if o.request.kind == k]), 2)
                                 for k in KINDS if any(o.request.kind == k for o in run.outcomes)}}
    (out_dir / f"vllm_server_load-{stamp}.json").write_text(json.dumps(result, indent=1, default=asdict))
    print(json.dumps({k: v for k, v in result.items() if k != "rss_samples"}, indent=1))
    failed = summary["problems"] or not alive or memory["growth_pct"] > args.max_growth
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
