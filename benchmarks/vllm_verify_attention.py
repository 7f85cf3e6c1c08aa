"""The attention of a verify pass on CPU, one layer: vLLM's own CPU kernel
(``cpu_attention_with_kv_cache``, what a verify pass runs without kvsieve) against kvsieve's
causal-rows kernel (``kvsieve/kernels/causal_rows``, what it runs under kvsieve's drafter) on the same
cache, for ``R`` = ``K + 1`` query rows per request, each row causal, side by side in one run.

    python benchmarks/vllm_verify_attention.py [--requests 8] [--length 8000] [--rows 1,3,5,9]
                                               [--heads 9,3,64] [--block-size 128] [--dtype float32]
                                               [--threads 2] [--out bench_out]

Runs in the vLLM virtual environment. The cache is vLLM's CPU layout (``[num_blocks, Hkv,
block_size, 2 * D]``, K by channel), random, every request ``--length`` positions (its last ``R``
the rows' own) in blocks out of order; ``--heads`` is ``Hq,Hkv,D`` (SmolLM2: ``9,3,64``; Gemma 3
270M: ``4,1,256``). Per ``R``: the median time of each kernel (``benchmarks/_timing.measure``), the
ratio, and each kernel's time over its own one-row time (how the cost grows with the rows: a kernel
that reads the context once per row grows about ``R``-fold). The two outputs are compared first
(fp32: 1e-4; bf16: 2e-2) and the run stops with status 1 if they differ. Prints the CPU line and
the load; writes ``--out/vllm_verify_attention-<UTC time>.json``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the benchmarks package

from benchmarks._timing import cpu_isa, load_averages, measure, write_stamped_json  # noqa: E402
from kvsieve.integrations.vllm.layouts import kv_views  # noqa: E402
from kvsieve.kernels.causal_rows import causal_rows_native  # noqa: E402

__all__ = ["main", "run_rows"]


def vllm_rows(raw: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, q: torch.Tensor, rows: int,
              scale: float) -> tuple[torch.Tensor, Any]:
    """vLLM's CPU kernel on ``rows`` causal query rows a request: ``(out [N, Hq, D], call)`` where
    ``call()`` runs it again (the scheduler metadata built once, as vLLM builds it once per step)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    nb, hkv, bs, two_d = raw.shape
    key_cache, value_cache = raw.view(nb, hkv, 2 * bs, two_d // 2).chunk(2, dim=2)
    n_req = table.shape[0]
    starts = torch.arange(n_req + 1, dtype=torch.int32) * rows
    isa = _get_attn_isa(raw.dtype, bs, two_d // 2)
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=n_req, num_heads=q.shape[1], num_kv_heads=hkv, head_dim=q.shape[2], seq_lens=lens.clone(),
        dtype=raw.dtype, query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False)
    out = torch.empty_like(q)

    def call() -> torch.Tensor:
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts, seq_lens=lens,
            scale=scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0,
            scheduler_metadata=sched, s_aux=None)
        return out

    return call(), call


def run_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row of results per ``R`` of ``args.rows`` (module docstring)."""
    hq, hkv, d = args.heads
    dtype = getattr(torch, args.dtype)
    bs, n_req, length = args.block_size, args.requests, args.length
    width = -(-length // bs)
    gen = torch.Generator().manual_seed(0)
    raw = torch.randn(n_req * width, hkv, bs, 2 * d, generator=gen).to(dtype)
    table_np = np.random.default_rng(0).permutation(n_req * width).astype(np.int32).reshape(n_req, width)
    table, lens = torch.from_numpy(table_np), torch.full((n_req,), length, dtype=torch.int32)
    k, v = kv_views("vllm-cpu", raw)
    scale = d ** -0.5
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    medians = []
    for rows in args.rows:
        q = torch.randn(n_req * rows, hq, d, generator=gen).to(dtype)
        qo = np.arange(n_req + 1, dtype=np.int64) * rows

        def ours() -> torch.Tensor:
            return causal_rows_native(k, v, table_np, qo, lens.numpy(), q, sm_scale=scale, threads=args.threads)[0]

        theirs, vllm_call = vllm_rows(raw, table, lens, q, rows, scale)
        if not torch.allclose(ours().to(dtype), theirs, atol=tol, rtol=tol):
            err = (ours().to(dtype) - theirs).abs().max().item()
            raise SystemExit(f"R={rows}: kvsieve's causal rows and vLLM's kernel differ (max |diff| {err:.3g})")
        t_vllm = measure(vllm_call, warmup=1, min_reps=5, budget_s=2.0)
        t_ours = measure(ours, warmup=1, min_reps=5, budget_s=2.0)
        medians.append((rows, t_vllm.median_s, t_ours.median_s, load_averages()[0]))
    # Figures keep microsecond precision and every ratio comes from the unrounded medians: at CI size a
    # kernel takes a few microseconds, where ratios of millisecond-rounded times are off by tens of percent.
    base_vllm, base_ours = medians[0][1], medians[0][2]
    return [{"rows": rows, "vllm_ms": round(s_vllm * 1e3, 6), "kvsieve_ms": round(s_ours * 1e3, 6),
             "vllm_over_kvsieve": round(s_vllm / s_ours, 4), "vllm_x_one_row": round(s_vllm / base_vllm, 4),
             "kvsieve_x_one_row": round(s_ours / base_ours, 4), "load": load}
            for rows, s_vllm, s_ours, load in medians]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--length", type=int, default=8000, help="positions cached per request, its rows included")
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 3, 5, 9],
                    help="comma-separated query rows per request (K + 1); the first is the ratios' base")
    ap.add_argument("--heads", type=lambda s: [int(x) for x in s.split(",")], default=[9, 3, 64], help="Hq,Hkv,D")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cpu = cpu_isa()
    print(f"CPU {cpu}; load {load_averages()}; {args.requests} requests x {args.length} positions, heads "
          f"{args.heads}, block {args.block_size}, {args.dtype}, {args.threads} threads", flush=True)
    results = run_rows(args)
    print("| rows a request | vLLM's kernel ms | kvsieve causal_rows ms | vLLM / kvsieve | vLLM x its 1 row "
          "| kvsieve x its 1 row |\n|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['rows']} | {r['vllm_ms']:.3f} | {r['kvsieve_ms']:.3f} | {r['vllm_over_kvsieve']:.2f} "
              f"| {r['vllm_x_one_row']:.2f} | {r['kvsieve_x_one_row']:.2f} |")
    write_stamped_json(args.out, "vllm_verify_attention", {"cpu": cpu, "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
