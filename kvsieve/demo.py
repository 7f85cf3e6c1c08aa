"""``kvsieve demo``: one selector end to end through the paged cache against the Vanilla golden.

A synthetic request with a planted "needle" (a key each decode query attends to strongly) is
prefilled, then decoded for a few steps; each step runs the selector through ``SparseAttention``
and, on a second cache, dense attention. Prints the relative output error against the dense
golden and the achieved attended fraction.
"""
from __future__ import annotations

import argparse
import json

import torch

from .cli import plain
from .metadata import KVCacheManager, KVCacheSpec
from .sparse import Engine, SparseAttention, SparseAttentionConfig, lower_config

__all__ = ["run_demo", "main"]


def _layer(plan, args) -> SparseAttention:  # noqa: ANN001
    return SparseAttention(layer_idx=0, num_q_heads=args.q_heads, num_kv_heads=args.kv_heads,
                           head_dim=args.head_dim, plan=plan, backend=args.backend)


def run_demo(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    blocks = -(-(args.context + args.steps) // args.page_size)
    spec = KVCacheSpec(num_layers=1, num_blocks=2 * blocks + 2, tokens_per_block=args.page_size,
                       num_kv_heads=args.kv_heads, head_dim=args.head_dim, max_requests=2, max_blocks_per_seq=blocks)
    params = json.loads(args.params) if args.params else {}
    plan = lower_config(SparseAttentionConfig(args.selector, params), num_layers=1)[0]
    sparse = Engine(KVCacheManager(spec), [_layer(plan, args)], max_num_requests=1, max_num_tokens=args.context)
    dense = Engine(KVCacheManager(spec), [_layer(None, args)], max_num_requests=1, max_num_tokens=args.context)
    hq, hkv, d = args.q_heads, args.kv_heads, args.head_dim
    k = torch.randn(args.context, hkv, d)
    v = torch.randn(args.context, hkv, d)
    needle = args.context // 3
    k[needle] = torch.randn(hkv, d) * 2.0
    q = torch.randn(args.context, hq, d)
    for eng in (sparse, dense):
        eng.step([0], [args.context], 1, [(q, k, v)])
    errors, fractions = [], []
    for _ in range(args.steps):
        qs = 0.4 * k[needle].repeat_interleave(hq // hkv, dim=0).unsqueeze(0) + torch.randn(1, hq, d)
        ks, vs = torch.randn(1, hkv, d), torch.randn(1, hkv, d)
        (res_s,) = sparse.step([0], [1], 0, [(qs, ks, vs)])
        (res_d,) = dense.step([0], [1], 0, [(qs, ks, vs)])
        errors.append(float((res_s.out - res_d.out).norm() / res_d.out.norm()))
        fractions.append(res_s.stats.attended_fraction)
    return {"selector": args.selector, "params": params, "backend": args.backend, "context": args.context,
            "decode_steps": args.steps, "mean_rel_error": sum(errors) / len(errors),
            "max_rel_error": max(errors), "attended_fraction": sum(fractions) / len(fractions)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--selector", default="oracle_topk", help="registered selector name (default: oracle_topk)")
    p.add_argument("--params", default='{"budget": 256}', help="selector config as JSON")
    p.add_argument("--backend", default="vanilla")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--q-heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvsieve demo", description=plain(__doc__.splitlines()[0]))
    add_arguments(p)
    r = run_demo(p.parse_args(argv))
    print(f"selector={r['selector']} params={r['params']} backend={r['backend']} context={r['context']}")
    print(f"decode steps: {r['decode_steps']}  attended fraction: {r['attended_fraction']:.4f} "
          f"(sparsity {1 - r['attended_fraction']:.2%})")
    print(f"relative output error vs dense Vanilla golden: mean {r['mean_rel_error']:.3e}, max {r['max_rel_error']:.3e}")
    return 0
