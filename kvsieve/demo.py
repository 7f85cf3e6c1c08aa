"""``kvsieve demo``: one selector end to end through the paged cache against the Vanilla golden.

A synthetic request with a planted "needle" (a key each decode query attends to strongly) is
prefilled, then decoded for a few steps; each step runs the selector through ``SparseAttention``
and, on a second cache, dense attention. Prints the relative output error against the dense
golden and the achieved attended fraction.

Without ``--params`` every built-in selector runs with :func:`demo_params` (sized to the
context); ``dsa`` reads finished index tensors built from the request's own first KV head
(a stand-in for a trained indexer, which needs a model: ``kvsieve distill-indexer``).
"""
from __future__ import annotations

import argparse
import json

import torch

from .metadata import KVCacheManager, KVCacheSpec
from .selectors.dsa import IndexerInputs
from .sparse import Engine, SparseAttention, SparseAttentionConfig, lower_config
from .terminal import plain

__all__ = ["run_demo", "demo_params", "main"]


def demo_params(selector: str, args: argparse.Namespace) -> dict:
    """The selector's configuration when ``--params`` is not given: about a quarter of the context
    kept where the selector has a budget; ``{}`` (its defaults) for a selector not listed here."""
    quarter = max(1, args.context // 4)
    return {
        "oracle_topk": {"budget": quarter},
        "streaming": {"budget": quarter},
        "quest": {"budget": max(quarter, 16)},
        "rocketkv": {"prompt_budget": max(quarter, 64), "window_size": 16, "kernel_size": 7},
        "snapkv": {"prompt_budget": max(quarter, 64), "window_size": 16},
        "block_select": {"block_size": args.page_size, "topk_blocks": max(1, quarter // args.page_size)},
        "skip_softmax": {"threshold_scale_factor_context": 100.0, "threshold_scale_factor_generation": 100.0},
        "dsa": {"index_topk": quarter, "n_heads": 1, "head_dim": args.head_dim, "rope_dim": 0},
    }.get(selector, {})


def _index_inputs(q: torch.Tensor, k: torch.Tensor, group: int) -> IndexerInputs:
    """DSA's finished index tensors from the step's own q/k: the first KV head's keys and the mean
    of its query group (one index head, weight 1)."""
    return IndexerInputs(q_index=q[:, :group].mean(1, keepdim=True), k_index=k[:, 0],
                         weights=torch.ones(q.shape[0], 1))


def _layer(plan, args) -> SparseAttention:  # noqa: ANN001
    return SparseAttention(layer_idx=0, num_q_heads=args.q_heads, num_kv_heads=args.kv_heads,
                           head_dim=args.head_dim, plan=plan, backend=args.backend)


def run_demo(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    blocks = -(-(args.context + args.steps) // args.page_size)
    spec = KVCacheSpec(num_layers=1, num_blocks=2 * blocks + 2, tokens_per_block=args.page_size,
                       num_kv_heads=args.kv_heads, head_dim=args.head_dim, max_requests=2, max_blocks_per_seq=blocks)
    params = json.loads(args.params) if args.params is not None else demo_params(args.selector, args)
    plan = lower_config(SparseAttentionConfig(args.selector, params), num_layers=1)[0]
    sparse = Engine(KVCacheManager(spec), [_layer(plan, args)], max_num_requests=1, max_num_tokens=args.context)
    dense = Engine(KVCacheManager(spec), [_layer(None, args)], max_num_requests=1, max_num_tokens=args.context)
    hq, hkv, d = args.q_heads, args.kv_heads, args.head_dim
    k = torch.randn(args.context, hkv, d)
    v = torch.randn(args.context, hkv, d)
    needle = args.context // 3
    k[needle] = torch.randn(hkv, d) * 2.0
    q = torch.randn(args.context, hq, d)
    group = hq // hkv
    wants_index = plan.selector.model_inputs_type is IndexerInputs
    (prefill,) = sparse.step([0], [args.context], 1, [(q, k, v)], [_index_inputs(q, k, group)] if wants_index else None)
    dense.step([0], [args.context], 1, [(q, k, v)])
    errors, fractions, skipped, walked = [], [], 0, 0
    for _ in range(args.steps):
        qs = 0.4 * k[needle].repeat_interleave(hq // hkv, dim=0).unsqueeze(0) + torch.randn(1, hq, d)
        ks, vs = torch.randn(1, hkv, d), torch.randn(1, hkv, d)
        (res_s,) = sparse.step([0], [1], 0, [(qs, ks, vs)], [_index_inputs(qs, ks, group)] if wants_index else None)
        (res_d,) = dense.step([0], [1], 0, [(qs, ks, vs)])
        errors.append(float((res_s.out - res_d.out).norm() / res_d.out.norm()))
        fractions.append(res_s.stats.attended_fraction)
        skipped, walked = skipped + res_s.stats.skipped_tiles, walked + res_s.stats.walked_tiles
    return {"selector": args.selector, "params": params, "backend": args.backend, "context": args.context,
            "decode_steps": args.steps, "mean_rel_error": sum(errors) / len(errors),
            "max_rel_error": max(errors), "attended_fraction": sum(fractions) / len(fractions),
            "kept_after_prefill": prefill.stats.kept_after_eviction, "skipped_tiles": skipped, "walked_tiles": walked}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--selector", default="oracle_topk", help="registered selector name (default: oracle_topk)")
    p.add_argument("--params", default=None, help="selector config as JSON (default: a configuration per "
                   "built-in selector keeping about a quarter of the context)")
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
    if r["kept_after_prefill"] is not None:
        print(f"prompt eviction at prefill: {r['kept_after_prefill']} positions kept (LayerStats.kept_after_eviction)")
    if r["walked_tiles"]:
        print(f"skip-softmax: {r['skipped_tiles']} of {r['walked_tiles']} KV tiles skipped")
    print(f"relative output error vs dense Vanilla golden: mean {r['mean_rel_error']:.3e}, max {r['max_rel_error']:.3e}")
    return 0
