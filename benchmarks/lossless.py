"""Lossless sparse decoding against dense decoding in kvsieve's own transformers session, side by
side in one process (the measurement behind docs/results/lossless.md).

    python benchmarks/lossless.py [--model smollm2] [--lengths 1024 4096] [--new 32]
                                  [--selector quest] [--density 16] [--k 2 4 8]

Per prompt length (an essay cut to about that many tokens): greedy decoding of ``--new`` tokens
(1) dense (``KvsieveSession(model, None)``: the same paged cache, dense attention), (2) sparse
(the selector at ``1/--density`` of the prompt, every step; tokens may differ: not lossless) and
(3) speculative at each ``--k`` (``speculate=K``: the selector drafts, a dense pass verifies).
Prints decode tokens/s (from the end of the prompt's step; the first token comes from that step), the speed-up
over dense, the mean accepted length, the mean time of a one-token step (dense, sparse, or a
draft) and of a verify step, the cost model's speed-up from them (``A * dense step / (K * draft
step + verify step)``, docs/lossless.md), and checks that every speculative run's tokens are dense
decoding's (a difference is allowed only where dense decoding's two top logits are a rounding
tie, :func:`~kvsieve.integrations.transformers.speculate.untied_mismatch`); any other difference
exits with status 1. The CPU line and the load averages at the start and the end are printed.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._timing import cpu_isa, load_averages  # noqa: E402
from kvsieve import SparseAttentionConfig  # noqa: E402
from kvsieve.eval.haystack import essay_haystack  # noqa: E402
from kvsieve.eval.model import load_model  # noqa: E402
from kvsieve.integrations.transformers import KvsieveSession  # noqa: E402
from kvsieve.integrations.transformers.speculate import untied_mismatch  # noqa: E402


def _decode_rate(session: KvsieveSession, ids: torch.Tensor, new: int, k: int | None
                 ) -> tuple[torch.Tensor, float, float | None, float, float | None]:
    """(new tokens [1, n], decode tokens/s after the prompt's step, mean accepted length or None, mean
    seconds of a one-token step, mean seconds of a verify step or None)."""
    run, prompt_done = session.run_logits, []
    steps: dict[bool, list[float]] = {False: [], True: []}  # dense (verify) step?

    def timed(ids: torch.Tensor, **kw: object) -> torch.Tensor:
        t0 = time.perf_counter()
        out = run(ids, **kw)
        if kw.get("new_requests"):
            prompt_done.append(time.perf_counter())
        else:
            steps[bool(kw.get("dense"))].append(time.perf_counter() - t0)
        return out

    session.run_logits = timed  # the prompt's step ends where decoding starts
    if k is None:
        tokens, accepted = session.generate(ids, new), None
    else:
        out = session.speculative_generate(ids, new)
        tokens, accepted = out.tokens, out.acceptance.mean_accepted_length
    rate = (tokens.shape[1] - 1) / (time.perf_counter() - prompt_done[0])
    verify = sum(steps[True]) / len(steps[True]) if steps[True] else None
    return tokens, rate, accepted, sum(steps[False]) / len(steps[False]), verify


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--selector", default="quest")
    ap.add_argument("--density", type=int, default=16, help="the selector's budget is 1/DENSITY of the prompt")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4, 8])
    args = ap.parse_args(argv)
    lm = load_model(args.model)
    print(f"CPU {cpu_isa()}; torch threads {torch.get_num_threads()}; load {load_averages()} at start")
    print(f"{lm.name}, {args.selector} at 1/{args.density}, {args.new} new tokens, greedy, fp32")
    print("| prompt tokens | mode | decode tok/s | x dense | mean accepted length | one-token step ms | "
          "verify step ms | cost model x dense | tokens |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---|")
    failed = False
    for length in args.lengths:
        ids = torch.tensor([lm.tokenizer.encode(essay_haystack(lm.tokenizer, length))])
        n = ids.shape[1]
        budget = max(16, n // args.density // 16 * 16)  # whole pages of 16
        cfg = SparseAttentionConfig(args.selector, {"budget": budget})
        runs: list[tuple[str, SparseAttentionConfig | None, int | None]] = [("dense", None, None),
                                                                           (f"sparse ({budget})", cfg, None)]
        runs += [(f"speculate K={k}", cfg, k) for k in args.k]
        dense_tokens, dense_rate, dense_step = None, None, None
        for label, config, k in runs:
            with KvsieveSession(lm.model, config, max_tokens=n + args.new + 16, decode_threads=1, speculate=k) as s:
                tokens, rate, accepted, step, verify = _decode_rate(s, ids, args.new, k)
            if dense_tokens is None:
                dense_tokens, dense_rate, dense_step = tokens, rate, step
            full = torch.cat([ids, tokens], dim=1)
            why = untied_mismatch(lm.model, n, torch.cat([ids, dense_tokens], dim=1), full)
            verdict = "dense's" if why is None else ("differ (not lossless)" if k is None else f"MISMATCH: {why}")
            failed |= k is not None and why is not None
            acc = "" if accepted is None else f"{accepted:.2f}"
            ver = "" if verify is None else f"{verify * 1e3:.0f}"
            model = "" if k is None else f"{accepted * dense_step / (k * step + verify):.2f}"
            print(f"| {n} | {label} | {rate:.2f} | {rate / dense_rate:.2f} | {acc} | {step * 1e3:.0f} | {ver} | "
                  f"{model} | {verdict} |", flush=True)
    print(f"load {load_averages()} at end")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
