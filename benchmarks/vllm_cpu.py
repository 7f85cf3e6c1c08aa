"""Prefill time and decode tokens/s of SmolLM2-135M in vLLM on CPU: vLLM's own attention vs the
kvsieve plug-in (dense and with selectors), measured side by side in one run.

    python benchmarks/vllm_cpu.py [--prompt-tokens 4000] [--max-tokens 32] [--reps 3] [--threads 1]
                                  [--modes own,dense,quest:budget=256]

Runs in the vLLM virtual environment (docs/vllm.md). One engine process per mode (the plug-in is
configured per process), all started first and kept; the repetitions then alternate the modes
(rep 1: own, dense, quest; rep 2: the same order ...), so a change of the machine's load falls on
neighbouring measurements of every mode alike. One repetition is one generation of one request,
the prompt prefilled cold (no prefix caching), with a timestamp per token: the engine is stepped
by hand (``LLMEngine.step``, one token per step for the one request), prefill = time from
``add_request`` to the first token, decode tokens/s = ``(max_tokens - 1) / (t_last - t_first)``,
and ``median_step_tok_s`` = 1 / the median time between two tokens (less sensitive to a burst of
other load during a few steps of the generation). ``--threads N`` runs every engine with N
unbound OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND=nobind``, ``OMP_NUM_THREADS=N``; default 1:
on a machine loaded beyond its cores, a thread of a parallel region that is descheduled stalls
its partners at every barrier, which hits the plug-in's many small torch ops far more than
vLLM's one C++ kernel per layer); ``--threads 0`` keeps vLLM's own thread binding.
Prints one JSON line per repetition and mode (with the load average around it), then per mode
the median and [min, max] over repetitions, and the median over repetitions of each mode's ratio
to the first mode in the same repetition. Wall-clock figures depend on the machine's load:
compare the ratios, not numbers across runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FILLER = ("The archive kept letters from sailors, merchants and clerks; each described the weather, the cargo, "
          "the price of grain and the names of the harbours they passed. ")


def worker(model: str, prompt_tokens: int, max_tokens: int) -> None:
    """One engine; answers each ``go`` line on stdin with one ``RESULT {json}`` line."""
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=model, dtype="bfloat16", max_model_len=prompt_tokens + max_tokens + 16, enforce_eager=True,
              max_num_seqs=1, seed=0, distributed_executor_backend="uni", enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    ids = tok.encode(FILLER * (prompt_tokens // 20 + 1))[:prompt_tokens]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.llm_engine
    print("READY", flush=True)
    for n, line in enumerate(sys.stdin):
        if line.strip() != "go":
            break
        t0 = time.perf_counter()
        engine.add_request(f"r{n}", TokensPrompt(prompt_token_ids=ids), params)
        stamps: list[float] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                while len(stamps) < len(out.outputs[0].token_ids):
                    stamps.append(time.perf_counter())
        if len(stamps) != max_tokens:
            raise RuntimeError(f"expected {max_tokens} tokens with ignore_eos, got {len(stamps)}")
        decode_s = stamps[-1] - stamps[0]
        step_s = statistics.median(b - a for a, b in zip(stamps, stamps[1:]))
        print("RESULT " + json.dumps({"prompt_tokens": len(ids), "prefill_s": round(stamps[0] - t0, 3),
                                      "decode_s": round(decode_s, 3),
                                      "decode_tok_s": round((max_tokens - 1) / decode_s, 3),
                                      "median_step_tok_s": round(1 / step_s, 3)}), flush=True)


def _start(mode: str, args: argparse.Namespace, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSIEVE_SELECTOR", "KVSIEVE_CONFIG"))}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    if args.threads:
        env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(args.threads))
    if mode != "own":
        env["KVSIEVE_SELECTOR"] = mode
    proc = subprocess.Popen([sys.executable, __file__, "--worker", "--model", args.model, "--prompt-tokens",
                             str(args.prompt_tokens), "--max-tokens", str(args.max_tokens)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
    _expect(proc, "READY", mode, log)
    return proc


def _expect(proc: subprocess.Popen, prefix: str, mode: str, log: Path) -> str:
    for line in proc.stdout:
        if line.startswith(prefix):
            return line[len(prefix):].strip()
    raise RuntimeError(f"mode {mode!r}: the engine process exited ({proc.wait()}); its log ends:\n"
                       + log.read_text()[-4000:])


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="converted SmolLM2 folder (default: convert or reuse the cached one)")
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", default="own,dense,quest:budget=256")
    ap.add_argument("--threads", type=int, default=1, help="OpenMP threads per engine, unbound (0: vLLM's binding)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # internal: one engine process
    args = ap.parse_args()
    if args.max_tokens < 2 or args.reps < 1 or args.threads < 0:
        ap.error("--max-tokens must be >= 2 (decode is timed between tokens), --reps >= 1 and --threads >= 0")
    if args.worker:
        worker(args.model, args.prompt_tokens, args.max_tokens)
        return
    if args.model is None:
        from kvsieve.eval.model import smollm2_gguf_path
        from kvsieve.integrations.vllm.convert import converted_checkpoint

        args.model = str(converted_checkpoint(smollm2_gguf_path()))
    modes = args.modes.split(",")
    logs = Path(tempfile.mkdtemp(prefix="vllm_cpu_"))
    procs, log = {}, {m: logs / f"engine-{i}.log" for i, m in enumerate(modes)}
    try:
        for mode in modes:  # one at a time: starting engines compete for the cores
            procs[mode] = _start(mode, args, log[mode])
        rows: dict[str, list[dict]] = {m: [] for m in modes}
        for rep in range(args.reps):
            for mode in modes:
                before = _load()
                procs[mode].stdin.write("go\n")
                procs[mode].stdin.flush()
                row = {"rep": rep, "mode": mode, **json.loads(_expect(procs[mode], "RESULT ", mode, log[mode])),
                       "load_before": before, "load_after": _load()}
                print(json.dumps(row), flush=True)
                rows[mode].append(row)
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait(timeout=120)
    _table(rows, modes)


def _table(rows: dict[str, list[dict]], modes: list[str]) -> None:
    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"

    base = modes[0]
    def ratio(mode: str, key: str) -> float:
        return statistics.median(r[key] / b[key] for r, b in zip(rows[mode], rows[base]))

    print(f"\nmedian [min, max] over {len(rows[base])} repetitions; ratios: median of per-repetition ratios to {base}")
    print(f"{'mode':24} {'prompt':>6} {'prefill s':>22} {'decode tok/s':>22} {'median-step tok/s':>22} "
          f"{'decode ratio':>12} {'step ratio':>10}")
    for mode in modes:
        print(f"{mode:24} {rows[mode][0]['prompt_tokens']:>6} {spread([r['prefill_s'] for r in rows[mode]]):>22} "
              f"{spread([r['decode_tok_s'] for r in rows[mode]]):>22} "
              f"{spread([r['median_step_tok_s'] for r in rows[mode]]):>22} {ratio(mode, 'decode_tok_s'):>12.2f} "
              f"{ratio(mode, 'median_step_tok_s'):>10.2f}")


if __name__ == "__main__":  # vLLM starts its engine with spawn where it uses processes: the guard is required
    main()
