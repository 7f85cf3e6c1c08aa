"""The plug-in under load in vLLM's offline engine: preemption, aborts, block reuse and prefix-cache
eviction, every finished request's greedy tokens compared with the same request run alone.

    python benchmarks/vllm_load.py [--model smollm2] [--requests 32] [--modes 'own;dense;quest;dsa']
                                   [--kv-blocks 24] [--check-state] [--out bench_out]

Runs in the vLLM virtual environment (docs/vllm.md). One engine process per mode (the plug-in is
configured per process: ``own`` = vLLM's own attention, ``dense``, ``quest`` / ``dsa`` = the
:data:`SELECTORS` strings, or any ``KVSIEVE_SELECTOR`` string; started by kvsieve's one launcher,
:mod:`kvsieve.eval.served.launch`, with ``OMP_NUM_THREADS`` (default 1) unbound threads), each
running :func:`run_load`:

* **the workload** (:func:`make_workload`, seeded): requests of mixed prompt lengths, each the
  prefix of one of a few families (whole blocks, so vLLM's prefix cache shares them) and a suffix of
  its own; they arrive a few per step while others decode; every ``--abort-every``-th request is
  aborted once it has ``--abort-after`` tokens (mid-decode);
* **the engine**: fp32, greedy (temperature 0, ``ignore_eos``), prefix caching and chunked prefill
  on, ``--max-num-seqs`` and ``--max-num-batched-tokens`` small and a KV cache of ``--kv-blocks``
  blocks, too small for the running requests, so vLLM preempts (and recomputes) requests, frees and
  reuses blocks and evicts cached prefix blocks;
* **the load loop** (``LLMEngine.add_request`` / ``abort_request`` / ``step``), bounded by
  ``--max-steps`` and ``--time-limit`` (exceeding either is an error), then **alone**: every request
  again, one at a time, the prefix cache reset before each, in the same engine;
* **counted**: preemptions (vLLM's ``vllm:num_preemptions`` counter), prefix-cache hits (vLLM's
  ``vllm:prefix_cache_hits``, tokens), aborts (``abort_request`` calls on requests that were
  decoding), evictions of cached blocks and block allocations (vLLM 0.32 counts neither: the driver
  wraps its ``BlockPool._maybe_evict_cached_block``, counting the calls that removed a cached
  block's hash, and ``BlockPool.get_new_blocks``, counting blocks handed out and those handed out
  again after an earlier request had them; and its scheduler's ``_preempt_request``, logging which
  request each preemption hit and how many tokens it had generated), steps, and the engine
  process's resident memory.

:func:`mismatches` compares each request's load tokens with its alone tokens (a finished request
all of them, an aborted one the tokens it had), a request vLLM preempted and recomputed included.
``--speculate K`` makes vLLM speculate with kvsieve's drafter (docs/lossless.md; the selector modes:
the selector drafts, vLLM's own attention verifies) and counts the drafted and accepted tokens.
``--check-state`` turns on the plug-in's per-step
check of the selector's per-block state (``KVSIEVE_CHECK_STATE=1``, docs/vllm.md) in the selector
modes. Prints one JSON line per mode and a table; writes everything to
``--out/vllm_load-<UTC time>.json``. The CI-sized run is ``tests/vllm/test_load.py``.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the benchmarks package

from benchmarks._timing import cpu_isa, load_averages  # noqa: E402
from benchmarks.vllm_common import vllm_metric  # noqa: E402
from kvsieve.eval.served.launch import OWN, EngineLaunch, default_threads, drafter_config, model_folder  # noqa: E402

BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32
NUM_LAYERS, HIDDEN = 30, 576  # SmolLM2-135M
# the selector modes: Quest on 16-token pages (4 of them, against up to ~20 per request) and DSA keeping
# 64 tokens (a random indexer, {projections}) with fp32 index keys, and with its default bf16 keys:
# rounding a key to bf16 turns a last-bit difference of a hidden state between a batched step and a
# lone one into a whole bf16 step, which can swap two near-tied tokens (docs/results/vllm_load.md)
SELECTORS = {"quest": "quest:budget=64,page_size=16",
             "dsa": "dsa:projections={projections},index_topk=64,index_k_dtype=float32",
             "dsa-bf16": "dsa:projections={projections},index_topk=64"}


@dataclass(frozen=True)
class LoadRequest:
    """One request of the workload: ``prompt`` token ids, ``max_tokens`` to generate, ``arrival`` the
    load step it is added at, ``abort_after`` tokens after which it is aborted (``None``: runs to its end)."""

    rid: str
    prompt: list[int]
    max_tokens: int
    arrival: int
    abort_after: int | None


def make_workload(*, requests: int, seed: int, families: int = 3, prefix_blocks: tuple[int, int] = (2, 4),
                  suffix_tokens: tuple[int, int], max_tokens: tuple[int, int],
                  per_step: int = 1, abort_every: int = 4, abort_after: int = 3, vocab: tuple[int, int] = (200, 30000)
                  ) -> list[LoadRequest]:
    """``requests`` requests (seeded, so every mode and the alone run see the same ones): request ``i``
    takes family ``i % families``'s prefix (``prefix_blocks`` whole blocks of random tokens) and a
    random suffix of ``suffix_tokens`` tokens, generates ``max_tokens`` tokens, arrives at step
    ``i // per_step``; every ``abort_every``-th (``0``: none) is aborted after ``abort_after`` tokens."""
    import random

    rng = random.Random(seed)
    prefixes = [[rng.randrange(*vocab) for _ in range(BLOCK_SIZE * rng.randint(*prefix_blocks))]
                for _ in range(families)]
    out = []
    for i in range(requests):
        suffix = [rng.randrange(*vocab) for _ in range(rng.randint(*suffix_tokens))]
        aborted = abort_every > 0 and i % abort_every == abort_every - 1
        out.append(LoadRequest(f"r{i}", prefixes[i % families] + suffix, rng.randint(*max_tokens), i // per_step,
                               abort_after if aborted else None))
    return out


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class EngineCounters:
    """Wraps vLLM's engine core (in this process) to count what vLLM 0.32 does not: on its
    ``BlockPool``, cached blocks evicted (``_maybe_evict_cached_block`` returning True: a hash removed
    so the block can hold other tokens), blocks handed out (``get_new_blocks``) and, of those, blocks
    handed out again after an earlier allocation; on its scheduler, which request each preemption
    hit and how many tokens it had generated then (``_preempt_request``; their number is vLLM's own
    ``vllm:num_preemptions``)."""

    def __init__(self, pool, scheduler) -> None:  # noqa: ANN001 (vLLM's BlockPool and Scheduler)
        self.evictions = self.allocated = self.reused = 0
        self.preempted: list[tuple[str, int]] = []
        self._seen: set[int] = set()
        evict, new_blocks, preempt = pool._maybe_evict_cached_block, pool.get_new_blocks, scheduler._preempt_request

        def counting_evict(block) -> bool:  # noqa: ANN001
            evicted = evict(block)
            self.evictions += bool(evicted)
            return evicted

        def counting_new(num_blocks: int) -> list:
            blocks = new_blocks(num_blocks)
            ids = {b.block_id for b in blocks}
            self.allocated += len(blocks)
            self.reused += len(ids & self._seen)
            self._seen |= ids
            return blocks

        def logging_preempt(request, *args, **kwargs) -> None:  # noqa: ANN001
            # vLLM's internal id is the caller's plus "-" and 8 random characters
            self.preempted.append((request.request_id.rsplit("-", 1)[0], request.num_output_tokens))
            return preempt(request, *args, **kwargs)

        pool._maybe_evict_cached_block, pool.get_new_blocks = counting_evict, counting_new
        scheduler._preempt_request = logging_preempt


def run_load(args: argparse.Namespace) -> dict:
    """The engine side (this process, vLLM imported): the load loop, then each request alone."""
    from vllm import LLM, SamplingParams, TokensPrompt

    work = make_workload(requests=args.requests, seed=args.seed, per_step=args.per_step,
                         abort_every=args.abort_every, abort_after=args.abort_after,
                         suffix_tokens=_pair(args.suffix_tokens), max_tokens=_pair(args.max_tokens))
    longest = max(len(r.prompt) + r.max_tokens for r in work)
    llm = LLM(model=args.model, dtype="float32", max_model_len=-(-longest // BLOCK_SIZE) * BLOCK_SIZE,
              enforce_eager=True, seed=0, distributed_executor_backend="uni", block_size=BLOCK_SIZE,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_chunked_prefill=True, enable_prefix_caching=True, disable_log_stats=False,
              kv_cache_memory_bytes=args.kv_blocks * BLOCK_SIZE * args.kv_bytes_per_token,
              speculative_config=drafter_config(args.speculate) if args.speculate else None)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    counters = EngineCounters(scheduler.kv_cache_manager.block_pool, scheduler)
    params = {r.rid: SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in work}
    rss = [(0, _rss_mib())]

    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    aborted: set[str] = set()
    pending = list(work)
    t0, steps = time.monotonic(), 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].arrival <= steps:
            r = pending.pop(0)
            engine.add_request(r.rid, TokensPrompt(prompt_token_ids=r.prompt), params[r.rid])
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
            if out.finished:
                finished.add(out.request_id)
        steps += 1
        for r in work:  # abort the designated requests once they are decoding
            if (r.abort_after is not None and r.rid not in aborted and r.rid not in finished
                    and len(tokens.get(r.rid, ())) >= r.abort_after):
                engine.abort_request([r.rid])
                aborted.add(r.rid)
        if steps % 10 == 0:
            rss.append((steps, _rss_mib()))
        if steps >= args.max_steps or time.monotonic() - t0 > args.time_limit:
            raise RuntimeError(f"load loop bounded at {args.max_steps} steps / {args.time_limit} s: stopped after "
                               f"{steps} steps, {time.monotonic() - t0:.0f} s, {len(finished)} of {len(work)} "
                               "requests finished")
    rss.append((steps, _rss_mib()))
    load_s = time.monotonic() - t0
    preempted = list(counters.preempted)  # the load's (the alone runs below are never preempted)
    figures = {"steps": steps, "load_s": round(load_s, 1),
               "preemptions": int(vllm_metric(llm, "vllm:num_preemptions")),
               "prefix_cache_hit_tokens": int(vllm_metric(llm, "vllm:prefix_cache_hits")),
               "aborts": len(aborted), "finished": len(finished), "evictions": counters.evictions,
               "blocks_allocated": counters.allocated, "blocks_reused": counters.reused,
               "preempted_decoding": sum(n > 0 for _, n in preempted),
               "kv_blocks": int(llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)}
    if args.speculate:  # the load's drafts (vLLM's spec-decode counters, before the alone runs)
        figures.update(drafted=int(vllm_metric(llm, "vllm:spec_decode_num_draft_tokens")),
                       accepted=int(vllm_metric(llm, "vllm:spec_decode_num_accepted_tokens")))

    alone: dict[str, list[int]] = {}
    for r in work:
        engine.reset_prefix_cache()
        engine.add_request(r.rid + "-alone", TokensPrompt(prompt_token_ids=r.prompt), params[r.rid])
        for _ in range(args.max_steps):
            outs = engine.step()
            done = [o for o in outs if o.finished]
            if done:
                alone[r.rid] = list(done[0].outputs[0].token_ids)
                break
        else:
            raise RuntimeError(f"request {r.rid} alone did not finish in {args.max_steps} steps")
    rss.append((steps, _rss_mib()))
    return {"figures": figures, "rss_mib": rss, "requests": [
        {**{k: v for k, v in asdict(r).items() if k != "prompt"}, "prompt_len": len(r.prompt),
         "load": tokens.get(r.rid, []),
         "alone": alone[r.rid], "finished": r.rid in finished, "aborted": r.rid in aborted,
         "preempted_after": [n for rid, n in preempted if rid == r.rid]} for r in work]}


def mismatches(result: dict) -> list[str]:
    """One line per request whose load tokens differ from its alone tokens: a finished request must
    have all of them, an aborted one a prefix of them; any other request (neither) is listed too.
    A request vLLM preempted while decoding is recomputed as one prompt of its prompt and generated
    tokens; the plug-in selects those generated tokens as their decode steps did (docs/vllm.md,
    preemption), so it is held to the same rule."""
    bad = []
    for r in result["requests"]:
        load, alone = r["load"], r["alone"]
        where = f"{r['rid']} (prompt {r['prompt_len']}, preempted after {r['preempted_after']} tokens"
        if r["finished"] and load != alone:
            bad.append(f"{where}, finished): load {load} != alone {alone}")
        elif r["aborted"] and load != alone[: len(load)]:
            bad.append(f"{where}, aborted): load {load} is not a prefix of {alone}")
        elif not r["finished"] and not r["aborted"]:
            bad.append(f"{r['rid']}: neither finished nor aborted")
    return bad


def engine_command(model: str, out: Path, args: argparse.Namespace) -> list[str]:
    """The command running :func:`run_load` for ``model`` in its own process, writing JSON to ``out``."""
    return [sys.executable, __file__, "--engine", "--model", model, "--json", str(out),
            *(f"--{k.replace('_', '-')}={getattr(args, k)}" for k in WORKLOAD_ARGS)]


def _pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


WORKLOAD_ARGS = ("requests", "seed", "suffix_tokens", "max_tokens", "per_step", "abort_every", "abort_after", "max_num_seqs",
                 "max_num_batched_tokens", "kv_blocks", "kv_bytes_per_token", "max_steps", "time_limit", "speculate")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 or a checkpoint folder (SmolLM2's geometry)")
    ap.add_argument("--modes", default="own;dense;quest;dsa",
                    help="';'-separated: own, dense, quest, dsa, dsa-bf16 (SELECTORS) or a KVSIEVE_SELECTOR string")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--suffix-tokens", default="16,160", help="LO,HI: each prompt's own tokens after its prefix")
    ap.add_argument("--max-tokens", default="16,48", help="LO,HI: tokens each request generates")
    ap.add_argument("--per-step", type=int, default=1, help="requests arriving per load step")
    ap.add_argument("--abort-every", type=int, default=4)
    ap.add_argument("--abort-after", type=int, default=3, help="tokens a designated request has when aborted")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--max-num-batched-tokens", type=int, default=64)
    ap.add_argument("--kv-blocks", type=int, default=24, help=f"KV cache size in {BLOCK_SIZE}-token blocks")
    ap.add_argument("--kv-bytes-per-token", type=int, default=NUM_LAYERS * 2 * 3 * 64 * 4,
                    help="K+V bytes per token over all layers (SmolLM2-135M in fp32)")
    ap.add_argument("--max-steps", type=int, default=5000)
    ap.add_argument("--time-limit", type=float, default=3600.0, help="seconds for the load loop")
    ap.add_argument("--check-state", action="store_true", help="KVSIEVE_CHECK_STATE=1 in the selector modes")
    ap.add_argument("--speculate", type=int, default=0,
                    help="K > 0: vLLM speculates K tokens per step with kvsieve's drafter (selector modes only)")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    return ap


def mode_spec(mode: str, workdir: Path) -> str:
    """``own``/``dense`` as they are, the :data:`SELECTORS` by their names (DSA's random indexer
    written into ``workdir``), anything else a ``KVSIEVE_SELECTOR`` string."""
    if mode.startswith("dsa") and mode in SELECTORS:
        proj = workdir / "indexer.pt"
        if not proj.exists():
            write_random_indexer(proj)
        return SELECTORS[mode].format(projections=proj)
    return SELECTORS.get(mode, mode)


def write_random_indexer(path: Path) -> Path:
    """DSA index projections with random weights (seed 0; 4 heads x 32, RoPE on 16) for SmolLM2's
    layers, saved as ``kvsieve distill-indexer`` saves them (the plumbing, not the indexer's quality)."""
    import torch

    from kvsieve.selectors.dsa.projections import IndexerProjections, save_projections

    torch.manual_seed(0)
    save_projections(str(path), {i: IndexerProjections(HIDDEN, 4, 32, 16) for i in range(NUM_LAYERS)})
    return path


def run_mode(model: str, spec: str, args: argparse.Namespace, workdir: Path, *, check_state: bool,
             timeout: float) -> dict:
    """One engine process running ``spec`` (``own``: no plug-in) -> :func:`run_load`'s result."""
    out = workdir / f"load-{abs(hash(spec))}.json"
    # no VLLM_CPU_KVCACHE_SPACE (whole GiB): it would override kv_cache_memory_bytes
    env = EngineLaunch(spec, threads=default_threads(), check_state=check_state and spec not in (OWN, "dense")).env()
    proc = subprocess.run(engine_command(model, out, args), env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"mode {spec!r}: the engine exited {proc.returncode}:\n{proc.stdout[-2000:]}"
                           f"{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def main() -> None:
    args = parser().parse_args()
    if args.engine:
        Path(args.json).write_text(json.dumps(run_load(args)))
        return
    model = str(model_folder(args.model))
    workdir = Path(args.out) / "vllm_load_work"
    workdir.mkdir(parents=True, exist_ok=True)
    isa = cpu_isa()
    print(f"CPU: {isa}", flush=True)
    rows = []
    for mode in args.modes.split(";"):
        before = load_averages()
        t0 = time.monotonic()
        spec = mode_spec(mode, workdir)
        res = run_mode(model, spec, args, workdir, check_state=args.check_state, timeout=args.time_limit * 3 + 600)
        bad = mismatches(res)
        row = {"mode": mode, "spec": spec, **res["figures"], "mismatches": len(bad), "wall_s": round(time.monotonic() - t0),
               "rss_mib_first": round(res["rss_mib"][0][1]), "rss_mib_peak": round(max(r for _, r in res["rss_mib"])),
               "load_before": before, "load_after": load_averages(), "check_state": args.check_state,
               "bad": bad, "rss_mib": res["rss_mib"]}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "rss_mib"}), flush=True)
    cols = ("mode", "finished", "aborts", "preemptions", "preempted_decoding", "evictions", "blocks_reused",
            "prefix_cache_hit_tokens", "mismatches", "steps", "rss_mib_peak")
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(str(row[c]) for c in cols))
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = Path(args.out) / f"vllm_load-{stamp}.json"
    path.write_text(json.dumps({"args": vars(args), "cpu_isa": isa, "date_utc": stamp, "rows": rows}, indent=1))
    print(f"wrote {path}")
    if any(row["mismatches"] for row in rows):
        raise SystemExit("mismatches: " + "; ".join(b for row in rows if row["mismatches"] for b in row["bad"]))


if __name__ == "__main__":  # vLLM may start processes with spawn: the guard is required
    main()
