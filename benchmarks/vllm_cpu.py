"""Decode throughput of SmolLM2-135M in vLLM on CPU: vLLM's own attention vs the kvsieve plug-in
dense and with selectors, one long prompt, each mode in its own engine process, one at a time.

    python benchmarks/vllm_cpu.py [--prompt-tokens 1900] [--max-tokens 32] [--modes own,dense,quest:budget=256]

Runs in the vLLM virtual environment (docs/vllm.md). Per mode: one engine with prefix caching; a
1-token generation (the cold prefill), the same again (the prompt's full blocks now come from the
cache: only the last partial block is recomputed), then the full generation of the same prompt,
so decode tokens/s = (max_tokens - 1) / (t_full - t_cached). Prints one JSON line per mode and a
table with each mode's ratio to vLLM's own attention. Wall-clock figures depend on the machine's
load: compare ratios from one run, not numbers across runs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

FILLER = ("The archive kept letters from sailors, merchants and clerks; each described the weather, the cargo, "
          "the price of grain and the names of the harbours they passed. ")


def run_one(model: str, prompt_tokens: int, max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=model, dtype="bfloat16", max_model_len=2048, enforce_eager=True, max_num_seqs=1, seed=0,
              distributed_executor_backend="uni", enable_prefix_caching=True)
    tok = llm.get_tokenizer()
    ids = tok.encode(FILLER * (prompt_tokens // 20 + 1))[:prompt_tokens]
    prompt = TokensPrompt(prompt_token_ids=ids)
    times = []
    for n in (1, 1, max_tokens):  # cold prefill, cached prefill, cached prefill + decode
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        times.append(time.perf_counter() - t0)
    decode_s = times[2] - times[1]
    return {"prompt_tokens": len(ids), "prefill_s": round(times[0], 3), "decode_s": round(decode_s, 3),
            "decode_tok_s": round((max_tokens - 1) / decode_s, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="converted SmolLM2 folder (default: convert or reuse the cached one)")
    ap.add_argument("--prompt-tokens", type=int, default=1900)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--modes", default="own,quest:budget=256,streaming:budget=256,dense")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run a single mode in this process
    args = ap.parse_args()
    if args.one is not None:
        print("RESULT " + json.dumps(run_one(args.model, args.prompt_tokens, args.max_tokens)), flush=True)
        return
    if args.model is None:
        from kvsieve.eval.model import smollm2_gguf_path
        from kvsieve.integrations.vllm.convert import converted_checkpoint

        args.model = str(converted_checkpoint(smollm2_gguf_path()))
    rows = []
    for mode in args.modes.split(","):
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSIEVE_SELECTOR")}
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        if mode != "own":
            env["KVSIEVE_SELECTOR"] = mode
        proc = subprocess.run([sys.executable, __file__, "--one", mode, "--model", args.model, "--prompt-tokens",
                               str(args.prompt_tokens), "--max-tokens", str(args.max_tokens)], env=env,
                              capture_output=True, text=True, check=True)
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
        row = {"mode": mode, **json.loads(line[len("RESULT "):])}
        print(json.dumps(row), flush=True)
        rows.append(row)
    base = next((r for r in rows if r["mode"] == "own"), rows[0])
    print(f"\n{'mode':32} {'prompt':>6} {'prefill s':>9} {'decode tok/s':>12} {'vs own':>7}")
    for r in rows:
        print(f"{r['mode']:32} {r['prompt_tokens']:>6} {r['prefill_s']:>9.2f} {r['decode_tok_s']:>12.2f} "
              f"{r['decode_tok_s'] / base['decode_tok_s']:>7.2f}")


if __name__ == "__main__":  # vLLM starts its engine with spawn where it uses processes: the guard is required
    main()
