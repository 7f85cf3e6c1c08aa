"""Prefill time and decode output tokens/s in vLLM on CPU: vLLM's own attention vs the kvsieve
plug-in (dense and with selectors), at several concurrencies, measured side by side in one run.

    python benchmarks/vllm_cpu.py [--model smollm2] [--prompt-tokens 8000] [--concurrency 1,8]
                                  [--max-tokens 16] [--reps 2] [--threads 1] [--block-size 128] [--dtype bfloat16]
                                  [--modes own,dense,quest:budget=256,quest:budget=512] [--layer-times]
                                  [--shared-prefix]
                                  [--out bench_out]

Runs in the vLLM virtual environment (docs/vllm.md); the engines are started by kvsieve's one
launcher (:mod:`kvsieve.eval.served.launch`: environment, model folder, modes). ``--model``: a
built-in name (``smollm2``, ``gemma3-270m``: its GGUF package installed in the vLLM environment,
converted once to the fp32 folder kvsieve's ``load_model`` loads, under ``$KVSIEVE_CACHE/models``),
a ``.gguf`` file or a checkpoint folder; ``--dtype`` the
model's and cache's dtype (bf16 by default; fp32 where the CPU has no bf16 arithmetic and a bf16
prefill would take minutes). One engine
process per mode (the plug-in is configured per process), all started first and kept; the
repetitions then alternate the modes (rep 1: own, dense, quest at each concurrency; rep 2: the
same ...), so a change of the machine's load falls on neighbouring measurements of every mode.

One measurement = ``C`` requests added at once to vLLM's scheduler, request ``i`` with prompt ``i``
(``--prompt-tokens`` tokens, its first block distinct from every other prompt's, so no two requests
share a block), each generating greedy tokens (``ignore_eos``), the engine stepped by hand
(``LLMEngine.step``), every step timed. vLLM's prefix caching is on: a prompt is prefilled cold the
first time an engine sees it (``cold_prompts`` in the row) and found in the cache afterwards, so the
repetitions and the higher concurrencies re-prefill nothing they saw (each request still reads its
own blocks when it decodes; Quest's page summaries live per physical block and stay valid).
``--shared-prefix``: the prompts are one text (the same filler) with each request's own last line
(``Letter i.``), so every block but the last is one physical block read by every request, as when
sessions ask about one document held in the prefix cache; a measurement's requests then prefill the
document once between them, wherever vLLM's scheduler finds its blocks already computed.
Before any measurement each engine answers one warm-up request (a prompt of ``--prompt-tokens`` whose
first block is unlike every measured prompt's, two tokens): without it the mode measured first in a
run prefilled an 8K prompt 1-3 s slower than it did when measured second, whichever mode it was.
``prefill_s``: from adding the requests until every one has its first token (compare it only
between rows with the same ``cold_prompts``; the table's prefill column is the first repetition of
the first concurrency, prompts cold). ``decode_tok_s``: ``C`` / the median duration of the *decode
steps* (steps in which all ``C`` requests are past their prompt and each produced one token; every
request generates ``--max-tokens`` plus as many tokens as its staggered cold prefill chunks take). ``--threads N`` runs every
engine with N unbound OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND=nobind``; default 1: on a machine
loaded beyond its cores a descheduled thread stalls its partners at every barrier); ``--threads 0``
keeps vLLM's own binding. Every mode's engine stays up for the whole run, so a run whose engines' KV
space (room for the largest concurrency, or ``VLLM_CPU_KVCACHE_SPACE`` where the environment sets
it) and about 2 GiB each exceed the memory available is refused before any starts (:func:`check_memory`).

``--layer-times`` also times every attention layer's call in the decode steps (a forward pre-hook and
hook on each of vLLM's ``Attention`` modules, :class:`AttentionTimer`: the hooks cost every mode alike,
a few microseconds a layer): the row gets ``attn_ms`` (all layers) and ``full_attn_ms`` (the layers
without a sliding window: those a plug-in selector runs on; Gemma 3's sliding-window layers are
vLLM's own attention whole), medians over the decode steps, and the table a ``bound`` column for the
first mode: its step / (its step - its ``full_attn_ms``), the decode ratio against it of a mode whose
full-attention layers cost nothing and whose every other part costs what the first mode's does; and
per mode an ``attn ratio``: the first mode's step / (that step - its ``attn_ms`` + the mode's), the
decode ratio with the rest of the step (weights, sampling, vLLM's own work) taken as the first mode's
in the same repetition. Two engine processes of one model differ in that rest by a few percent from
run to run, in either direction; the attention ratio is what the attention path itself changed.

Prints one JSON line per (repetition, concurrency, mode) with the load average before and after,
then per concurrency and mode the median and [min, max] over repetitions, and the median over
repetitions of each mode's ratio to the first mode in the same repetition; writes everything
(arguments, rows, the table) to ``--out/vllm_cpu-<UTC time>.json``. Wall-clock figures depend on the
machine's load: compare the ratios, not numbers across runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the benchmarks package

from benchmarks._timing import cpu_isa  # noqa: E402
from benchmarks.vllm_common import FILLER, parse_modes  # noqa: E402
from kvsieve.eval.served.launch import EngineLaunch, EngineProcess, model_folder  # noqa: E402

KV_ELEMENTS_PER_TOKEN = {"smollm2": 30 * 2 * 3 * 64, "gemma3-270m": 18 * 2 * 1 * 256}  # K+V, all layers
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class AttentionTimer:
    """Wall time of every attention layer's call, per engine step: ``layers`` maps each layer index to
    its attention module (refused when empty: there would be nothing to time); a forward pre-hook and a
    hook on each time its call. ``full``: the layer indices without a sliding window
    (``module.impl.sliding_window`` is ``None`` or ``-1``; a module without that attribute is refused);
    ``clock``: seconds (``time.perf_counter``)."""

    def __init__(self, layers: dict[int, torch.nn.Module], clock: Callable[[], float] = time.perf_counter) -> None:
        if not layers:
            raise ValueError("AttentionTimer: no attention layers to time (--layer-times needs the engine's "
                             "attention modules in this process)")
        self.full: set[int] = set()
        self._clock = clock
        self._start: dict[int, float] = {}
        self._times: dict[int, float] = {}
        for i, module in layers.items():
            if module.impl.sliding_window in (None, -1):
                self.full.add(i)
            module.register_forward_pre_hook(lambda _m, _a, i=i: self._start.__setitem__(i, self._clock()))
            module.register_forward_hook(lambda _m, _a, _o, i=i: self._add(i))

    def _add(self, i: int) -> None:
        self._times[i] = self._times.get(i, 0.0) + self._clock() - self._start.pop(i)

    def take(self) -> dict[int, float]:
        """The seconds each layer's calls took since the last take (cleared)."""
        times, self._times = self._times, {}
        return times

    def summary(self, steps: list[dict[int, float]]) -> dict[str, float]:
        """Medians over ``steps`` (each a :meth:`take`) of all layers' and the full-attention layers'
        milliseconds a step."""
        return {"attn_ms": round(1e3 * statistics.median(sum(t.values()) for t in steps), 3),
                "full_attn_ms": round(1e3 * statistics.median(sum(v for i, v in t.items() if i in self.full)
                                                              for t in steps), 3)}


def worker(args: argparse.Namespace) -> None:
    """One engine; answers each ``go C`` line on stdin with one ``RESULT {json}`` line."""
    from vllm import LLM, SamplingParams, TokensPrompt

    conc = max(args.concurrency)
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=_max_len(args), enforce_eager=True,
              max_num_seqs=conc, block_size=args.block_size, seed=0, distributed_executor_backend="uni",
              enable_prefix_caching=True)
    tok = llm.get_tokenizer()
    prompts = prompt_ids(tok, conc, args.prompt_tokens, shared_prefix=args.shared_prefix)
    engine = llm.llm_engine
    chunk = engine.vllm_config.scheduler_config.max_num_batched_tokens
    timer = None
    if args.layer_times:  # one process (VLLM_ENABLE_V1_MULTIPROCESSING=0): the engine's config holds its layers
        from vllm.model_executor.models.utils import extract_layer_index

        layers = engine.vllm_config.compilation_config.static_forward_context
        by_index = {extract_layer_index(name): module for name, module in layers.items()}
        if len(by_index) != len(layers):
            raise SystemExit(f"--layer-times: attention modules share a layer index ({sorted(layers)}); the "
                             "timer keeps one per layer")
        timer = AttentionTimer(by_index)
    # one warm-up request, its prompt unlike every measured one (a first block of its own): the engine's
    # first-request costs (allocations, oneDNN's primitives for a chunk's shapes) fall on no measurement
    warm = prompt_ids(tok, conc + 1, args.prompt_tokens, shared_prefix=False)[conc]
    llm.generate([TokensPrompt(prompt_token_ids=warm)], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                 use_tqdm=False)
    prefilled: set[int] = set()
    print("READY", flush=True)
    for n, line in enumerate(sys.stdin):
        cmd = line.split()
        if not cmd or cmd[0] != "go":
            break
        c = int(cmd[1])
        cold = sorted(set(range(c)) - prefilled)
        # decode steps with all c requests running: the staggered prefill chunks come on top
        extra = -(-len(cold) * args.prompt_tokens // chunk) + 1
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens + extra, ignore_eos=True)
        t0 = time.perf_counter()
        for i in range(c):
            engine.add_request(f"r{n}-{i}", TokensPrompt(prompt_token_ids=prompts[i]), params)
        counts: dict[str, int] = {}
        decode_steps: list[float] = []
        layer_steps: list[dict[int, float]] = []
        prefilled_at = None
        while engine.has_unfinished_requests():
            ready = len(counts) == c and min(counts.values()) > 0
            running = sum(1 for k in counts if counts[k] < args.max_tokens + extra) if ready else 0
            s0 = time.perf_counter()
            outs = engine.step()
            s1 = time.perf_counter()
            layer_times = timer.take() if timer is not None else None
            new = 0
            for out in outs:
                got = len(out.outputs[0].token_ids)
                new += got - counts.get(out.request_id, 0)
                counts[out.request_id] = got
            if ready and running == c and new == c:
                decode_steps.append(s1 - s0)
                if layer_times is not None:
                    layer_steps.append(layer_times)
            if prefilled_at is None and len(counts) == c and min(counts.values()) > 0:
                prefilled_at = s1
        if len(decode_steps) < 2:
            raise RuntimeError(f"only {len(decode_steps)} decode steps with all {c} requests running")
        step = statistics.median(decode_steps)
        prefilled.update(cold)
        print("RESULT " + json.dumps({"prompt_tokens": len(prompts[0]), "concurrency": c, "cold_prompts": len(cold),
                                      "prefill_s": round(prefilled_at - t0, 3),
                                      "decode_steps": len(decode_steps), "decode_step_ms": round(1e3 * step, 2),
                                      "decode_tok_s": round(c / step, 3),
                                      **(timer.summary(layer_steps) if timer is not None else {})}), flush=True)


def prompt_ids(tok: Any, n: int, tokens: int, *, shared_prefix: bool) -> list[list[int]]:
    """``n`` prompts of ``tokens`` token ids each (``tok``: the model's tokenizer): ``Letter i.`` then
    the filler text, so no two share their first block; or (``shared_prefix``) the filler text then
    `` Letter i.``, so all share every token before their last line."""
    filler = tok.encode(FILLER * (tokens // 20 + 1), add_special_tokens=False)
    if not shared_prefix:
        prompts = [(tok.encode(f"Letter {i}.") + filler)[:tokens] for i in range(n)]
    else:
        lines = [tok.encode(f" Letter {i}.", add_special_tokens=False) for i in range(n)]
        prompts = [filler[: max(tokens - len(line), 0)] + line for line in lines]
    if any(len(p) != tokens for p in prompts):
        got = sorted({len(p) for p in prompts})
        raise ValueError(f"--prompt-tokens {tokens}: the prompts came out {got} tokens long"
                         f"{' (each request line alone is longer)' if shared_prefix else ''}")
    return prompts


def _max_len(args: argparse.Namespace) -> int:
    return args.prompt_tokens + args.max_tokens + max(args.concurrency) * -(-args.prompt_tokens // 2048) + 16


def _kv_space_gib(args: argparse.Namespace) -> int:
    """Room for every prompt (kept in vLLM's prefix cache) and the generations, twice over."""
    per_token = KV_ELEMENTS_PER_TOKEN.get(args.model_name, 30 * 2 * 8 * 128) * DTYPE_BYTES[args.dtype]
    tokens = 2 * max(args.concurrency) * (_max_len(args) + args.block_size)
    return max(1, -(-per_token * tokens // 2 ** 30))


ENGINE_OVERHEAD_GIB = 2  # an engine's memory beyond its KV space (SmolLM2 fp32: 8.1 GB resident with 6 GiB of KV)


def check_memory(n_engines: int, kv_gib: int, available_gib: float) -> None:
    """Refuse a run whose engines, all up at once (one per mode), would not fit in the memory there
    is: each holds its KV space and about :data:`ENGINE_OVERHEAD_GIB` more, and one that does not fit
    is killed by the kernel's out-of-memory killer half-way through the run."""
    need = n_engines * (kv_gib + ENGINE_OVERHEAD_GIB)
    if need > available_gib:
        raise SystemExit(f"vllm_cpu: {n_engines} engines (one per mode, all up at once) need about {need} GiB "
                         f"({kv_gib} GiB of KV space each for the largest concurrency, plus {ENGINE_OVERHEAD_GIB}); "
                         f"{available_gib:.1f} GiB are available. Run fewer modes at a time (keep 'own' in each "
                         "run for its ratios), a lower --concurrency, or bf16")


def _available_gib() -> float:
    """``MemAvailable`` of ``/proc/meminfo`` in GiB (a kernel without the field is refused: the
    memory check would otherwise be skipped unsaid)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2 ** 20
    raise SystemExit("vllm_cpu: /proc/meminfo has no MemAvailable line, so the engines' memory cannot be checked "
                     "before they start")


def _start(mode: str, args: argparse.Namespace, log: Path) -> EngineProcess:
    launch = EngineLaunch(mode, threads=args.threads or None, kv_cache_gib=_kv_space_gib(args))
    cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--model-name", args.model_name,
           "--prompt-tokens", str(args.prompt_tokens),
           "--max-tokens", str(args.max_tokens), "--concurrency", ",".join(map(str, args.concurrency)),
           "--block-size", str(args.block_size), "--dtype", args.dtype,
           *(["--layer-times"] if args.layer_times else []), *(["--shared-prefix"] if args.shared_prefix else [])]
    return EngineProcess(mode, cmd, launch.env(), log)


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, gemma3-270m or a checkpoint folder")
    ap.add_argument("--prompt-tokens", type=int, default=8000)
    ap.add_argument("--concurrency", default="1,8", help="comma-separated numbers of concurrent requests")
    ap.add_argument("--max-tokens", type=int, default=16, help="decode steps timed per measurement")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=128, help="vLLM's KV block size (a multiple of 32 on CPU)")
    ap.add_argument("--modes", default="own,dense,quest:budget=256,quest:budget=512",
                    help="own, dense, KVSIEVE_SELECTOR strings or KVSIEVE_CONFIG files (.yaml/.yml/.json)")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES), help="model and KV cache dtype")
    ap.add_argument("--threads", type=int, default=1, help="OpenMP threads per engine, unbound (0: vLLM's binding)")
    ap.add_argument("--layer-times", action="store_true",
                    help="also time each attention layer's call in the decode steps (module hooks; module docstring)")
    ap.add_argument("--shared-prefix", action="store_true",
                    help="the requests' prompts share all but their last line (one document; module docstring)")
    ap.add_argument("--out", default="bench_out", help="folder of the JSON result")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # internal: one engine process
    ap.add_argument("--model-name", help=argparse.SUPPRESS)  # internal: the worker's --model before resolving
    args = ap.parse_args()
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    if args.max_tokens < 2 or args.reps < 1 or args.threads < 0 or min(args.concurrency) < 1:
        ap.error("--max-tokens must be >= 2, --reps >= 1, --threads >= 0 and every concurrency >= 1")
    if args.worker:
        worker(args)
        return
    args.model_name, args.model = args.model, str(model_folder(args.model))
    modes = parse_modes(args.modes)
    check_memory(len(modes), EngineLaunch(kv_cache_gib=_kv_space_gib(args)).kv_space_gib(), _available_gib())
    isa = cpu_isa()
    print(f"CPU {isa}", flush=True)
    logs = Path(tempfile.mkdtemp(prefix="vllm_cpu_"))
    procs, log = {}, {m: logs / f"engine-{i}.log" for i, m in enumerate(modes)}
    started = datetime.now(timezone.utc)
    rows: list[dict] = []
    try:
        for mode in modes:  # one at a time: starting engines compete for the cores
            procs[mode] = _start(mode, args, log[mode])
        for rep in range(args.reps):
            for c in args.concurrency:
                for mode in modes:
                    before = _load()
                    procs[mode].send(f"go {c}")
                    row = {"rep": rep, "mode": mode, **json.loads(procs[mode].read("RESULT ")),
                           "load_before": before, "load_after": _load()}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    finally:
        for proc in procs.values():
            proc.close()
    table = _table(rows, modes, args.concurrency)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"vllm_cpu-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "worker"}, "cpu": isa,
                                "started_utc": started.isoformat(timespec="seconds"),
                                "finished_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                "rows": rows, "table": table}, indent=1))
    print(f"\nwritten: {path}")


def _table(rows: list[dict], modes: list[str], concurrency: list[int]) -> list[dict]:
    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"

    base = modes[0]
    print(f"\nmedian [min, max] over repetitions; ratio: median of per-repetition ratios to {base!r}; prefill: "
          "the measurements whose prompts were all cold")
    timed = all("attn_ms" in r for r in rows)
    extra = f" {'attn ms':>8} {'full-attn ms':>12} {'attn ratio':>10} {'bound':>6}" if timed else ""
    print(f"{'conc':>4} {'mode':36} {'cold prefill s':>15} {'prefill speed':>13} {'decode tok/s':>22} "
          f"{'decode ratio':>12}{extra}")
    table = []
    for c in concurrency:
        base_rows = {r["rep"]: r for r in rows if r["mode"] == base and r["concurrency"] == c}
        for mode in modes:
            mine = [r for r in rows if r["mode"] == mode and r["concurrency"] == c]
            dec = statistics.median(r["decode_tok_s"] / base_rows[r["rep"]]["decode_tok_s"] for r in mine)
            cold = [r for r in mine if r["cold_prompts"] == c and base_rows[r["rep"]]["cold_prompts"] == c]
            pre = statistics.median(base_rows[r["rep"]]["prefill_s"] / r["prefill_s"] for r in cold) if cold else None
            pre_s = statistics.median(r["prefill_s"] for r in cold) if cold else None
            entry = {"concurrency": c, "mode": mode, "cold_prefill_s": pre_s, "prefill_speed_ratio": pre,
                     "decode_tok_s": statistics.median(r["decode_tok_s"] for r in mine),
                     "decode_tok_s_min": min(r["decode_tok_s"] for r in mine),
                     "decode_tok_s_max": max(r["decode_tok_s"] for r in mine), "decode_ratio": round(dec, 3)}
            line = ""
            if timed:
                entry["attn_ms"] = statistics.median(r["attn_ms"] for r in mine)
                entry["full_attn_ms"] = statistics.median(r["full_attn_ms"] for r in mine)
                att = statistics.median(same_rest_ratio(base_rows[r["rep"]], r) for r in mine)
                bound = statistics.median(free_full_attention_bound(r) for r in mine) if mode == base else None
                entry["attn_ratio"] = round(att, 3)
                entry["bound"] = None if bound is None else round(bound, 3)
                line = (f" {entry['attn_ms']:>8.2f} {entry['full_attn_ms']:>12.2f} {att:>10.3f} "
                        f"{'-' if bound is None else f'{bound:.3f}':>6}")
            print(f"{c:>4} {mode:36} {'-' if pre_s is None else f'{pre_s:.2f}':>15} "
                  f"{'-' if pre is None else f'{pre:.2f}':>13} {spread([r['decode_tok_s'] for r in mine]):>22} "
                  f"{dec:>12.2f}{line}")
            table.append(entry)
    return table


def same_rest_ratio(base: dict, row: dict) -> float:
    """``row``'s decode ratio against ``base`` (the first mode's row of the same repetition) with the
    rest of the step, everything but the attention layers' calls, taken as ``base``'s: base step /
    (base step - base ``attn_ms`` + row ``attn_ms``)."""
    return base["decode_step_ms"] / (base["decode_step_ms"] - base["attn_ms"] + row["attn_ms"])


def free_full_attention_bound(row: dict) -> float:
    """The decode ratio against ``row``'s mode that a mode would reach whose full-attention layers
    cost nothing and whose every other part of the step costs what ``row``'s does: step / (step -
    ``full_attn_ms``), from the row's median step (``decode_step_ms``)."""
    return row["decode_step_ms"] / (row["decode_step_ms"] - row["full_attn_ms"])


if __name__ == "__main__":  # vLLM starts its engine with spawn where it uses processes: the guard is required
    main()
