"""Prompt rows over runs of vLLM's CPU cache: kvsieve's tiled prompt kernel
(:mod:`kvsieve.kernels.prompt_runs`, the vLLM plug-in's path for prompt rows that select positions)
against the decode kernel on the same runs (each row on its own). What the prompt costs against
vLLM's own attention is ``benchmarks/vllm_cpu.py``'s TTFT (whole engines).

One request of ``--length`` positions in a paged cache of vLLM's CPU layout (K by channel); its last
``--rows`` positions are the prompt rows (vLLM's chunk), each with its causal length. Selections, the
same for every KV head:

* ``window``: StreamingLLM's, ``--sinks`` sinks plus the most recent positions, ``--budget`` in all;
* ``pages``: whole cache blocks, the row's own block and the sink block plus random earlier ones,
  ``--budget`` positions in all (a page selector's, Quest or block_select at the cache's block);
* ``tokens``: ``--budget`` positions drawn at random from the causal prefix (a token selector's
  without locality, DSA's worst case for the tiled kernel).

The kernels' outputs are checked against each other before timing (a difference stops the run).
Prints a table (milliseconds per call and ratios) with the CPU line and load; writes
``prompt_runs-<UTC>.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from kvsieve.integrations.vllm.layouts import kv_views
from kvsieve.kernels.prompt_runs.native import prompt_runs_native
from kvsieve.kernels.sparse_gqa_decode.native import sparse_decode_runs_native
from kvsieve.kernels.sparse_gqa_decode.runs import TokenRuns, selection_runs
from kvsieve.selectors.streaming.selector import streaming_topk
from kvsieve.sparse import SparseRuntimeParams

from ._timing import cpu_isa, load_averages, measure, write_stamped_json

__all__ = ["SELECTIONS", "selection", "main"]

SELECTIONS = ("window", "pages", "tokens")


def selection(kind: str, lens: torch.Tensor, budget: int, sinks: int, block: int, seed: int) -> torch.Tensor:
    """int32 ``[rows, budget]`` positions (``-1`` padded) each row selects (module docstring); row ``i``
    may attend ``[0, lens[i])``."""
    if kind == "window":
        return streaming_topk(lens, budget, sinks)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n in lens.tolist():
        if kind == "tokens":
            pick = torch.randperm(n, generator=gen)[:budget]
        else:
            own, pages = (n - 1) // block, max(1, budget // block)
            earlier = 1 + torch.randperm(max(own - 1, 0), generator=gen)[: max(pages - 2, 0)]
            chosen = torch.unique(torch.cat([torch.tensor([0, own]), earlier]))
            pick = (chosen[:, None] * block + torch.arange(block)).flatten()
            pick = pick[pick < n]
        rows.append(F.pad(pick, (0, budget + block - pick.numel()), value=-1))
    return torch.stack(rows).to(torch.int32)


def _runs(sel: torch.Tensor, hkv: int, lens: torch.Tensor, table: np.ndarray, block: int) -> TokenRuns:
    params = SparseRuntimeParams.from_topk(sel[:, None].expand(-1, hkv, -1))
    return selection_runs(params.sparse_attn_indices.numpy(), params.sparse_attn_offsets.numpy(), 1,
                          np.tile(table, (lens.numel(), 1)), lens.numpy().astype(np.int32), block)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One result row per selection of ``args.selections``."""
    hq, hkv, d = args.heads
    dtype = getattr(torch, args.dtype)
    width = -(-args.length // args.block_size)
    gen = torch.Generator().manual_seed(0)
    raw = torch.randn(width, hkv, args.block_size, 2 * d, generator=gen).to(dtype)
    table = np.random.default_rng(0).permutation(width).astype(np.int32)
    k, v = kv_views("vllm-cpu", raw)
    lens = torch.arange(args.length - args.rows + 1, args.length + 1)
    q = torch.randn(args.rows, hq, d, generator=gen).to(dtype)
    scale = d ** -0.5
    results = []
    for kind in args.selections:
        sel = selection(kind, lens, args.budget, args.sinks, args.block_size, seed=1)
        runs = _runs(sel, hkv, lens, table, args.block_size)

        def tiled() -> torch.Tensor:
            return prompt_runs_native(k, v, runs, q, sm_scale=scale)[0]

        def per_row() -> torch.Tensor:
            return sparse_decode_runs_native(k, v, runs, q, sm_scale=scale)[0]

        err = (tiled() - per_row()).abs().max().item()
        if err > (1e-4 if dtype == torch.float32 else 2e-2):
            raise SystemExit(f"{kind}: the tiled prompt kernel and the decode kernel differ (max |diff| {err:.3g})")
        t_tiled = measure(tiled, warmup=1, min_reps=3, budget_s=args.budget_s)
        t_row = measure(per_row, warmup=1, min_reps=3, budget_s=args.budget_s)
        results.append({"selection": kind, "selected_per_row": round(float(runs.attended.mean()), 1),
                         "tiled_ms": round(t_tiled.median_s * 1e3, 6), "per_row_ms": round(t_row.median_s * 1e3, 6),
                         "per_row_over_tiled": round(t_row.median_s / t_tiled.median_s, 4), "load": load_averages()[0]})
    return results


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=8192, help="positions of the request, its rows included")
    ap.add_argument("--rows", type=int, default=512, help="prompt rows, the request's last positions")
    ap.add_argument("--budget", type=int, default=512, help="positions each row selects")
    ap.add_argument("--sinks", type=int, default=4, help="the window selection's sinks")
    ap.add_argument("--selections", type=lambda s: s.split(","), default=list(SELECTIONS))
    ap.add_argument("--heads", type=lambda s: [int(x) for x in s.split(",")], default=[9, 3, 64], help="Hq,Hkv,D")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=2.0, help="timing budget per kernel")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.selections) - set(SELECTIONS))
    if unknown:
        raise SystemExit(f"--selections: unknown {unknown}; choose from {list(SELECTIONS)}")
    if not 1 <= args.rows <= args.length:
        raise SystemExit(f"--rows {args.rows}: the request's last rows, 1 to --length ({args.length})")
    if "pages" in args.selections and (args.budget % args.block_size or args.budget < 2 * args.block_size):
        raise SystemExit(f"--budget {args.budget}: the pages selection takes whole blocks of --block-size "
                         f"{args.block_size}, at least two (the sink block and the row's own)")
    if args.heads[0] % args.heads[1]:
        raise SystemExit(f"--heads {args.heads}: Hq must be a multiple of Hkv")
    torch.set_num_threads(args.threads)
    cpu = cpu_isa()
    print(f"CPU {cpu}; load {load_averages()}; one request of {args.length} positions, its last {args.rows} rows; "
          f"budget {args.budget}; heads {args.heads}, block {args.block_size}, {args.dtype}, {args.threads} threads "
          f"(torch; the kernels' OpenMP threads: OMP_NUM_THREADS)", flush=True)
    results = run(args)
    print("| selection | selected a row | tiled ms | per-row ms | per-row / tiled |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['selection']} | {r['selected_per_row']} | {r['tiled_ms']:.2f} | {r['per_row_ms']:.2f} | "
              f"{r['per_row_over_tiled']:.2f} |")
    write_stamped_json(args.out, "prompt_runs", {"cpu": cpu, "args": vars(args), "results": results})
    return results


if __name__ == "__main__":
    main()
