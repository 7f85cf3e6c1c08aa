"""Per-stage time of one attention layer of the vLLM plug-in on CPU, one decode token per request,
against vLLM's own kernel on the same cache (the profile behind docs/results/vllm.md).

    python benchmarks/vllm_cpu_layer.py [--kv-len 8000] [--requests 1] [--block-size 128]
                                        [--selector quest:budget=256,page_size=128]

Runs in the vLLM virtual environment, one torch thread. SmolLM2-135M's attention geometry (3 KV
heads, 3 query heads each, head dim 64), bf16, vLLM's ``vec`` CPU layout with ``--block-size`` blocks,
random K/V; the selector's page summaries are built once (as the prompt step would). Each stage is
timed alone (median of 200 calls, warm): vLLM's own dense kernel; the step's view and tables;
the selector (``on_append``, ``predict_attn``, ``validate``); the per-(row, KV head) block tables;
vLLM's paged kernel on them; and the whole plug-in layer call (``LayerRunner.forward`` with vLLM's
kernels). Prints milliseconds and the load average.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch


def _median_ms(fn, n: int = 200) -> float:  # noqa: ANN001
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-len", type=int, default=8000)
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=128, help="vLLM's KV block size (a multiple of 32)")
    ap.add_argument("--selector", default="quest:budget=256,page_size=128")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from vllm import _custom_ops as ops

    from kvsieve.integrations.vllm.config import PluginConfig, lower_plans, parse_selector_spec
    from kvsieve.integrations.vllm.cpu import VllmHostAttention
    from kvsieve.integrations.vllm.host import per_head_block_tables
    from kvsieve.integrations.vllm.layouts import kv_views
    from kvsieve.integrations.vllm.step import LayerRunner, StepTranslator, VllmStep
    from kvsieve.metadata.foreign_paged import ForeignKVSpec, ForeignPagedKV
    from kvsieve.sparse import AttentionGeometry, get_backend

    hkv, g, d, bs, dtype, b, length = 3, 3, 64, args.block_size, torch.bfloat16, args.requests, args.kv_len
    per_req = -(-length // bs)
    num_blocks = per_req * b + 1
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(num_blocks, hkv, bs, 2 * d, generator=gen).to(dtype)
    table = np.arange(1, 1 + per_req * b, dtype=np.int32).reshape(b, per_req)
    view = ForeignPagedKV(ForeignKVSpec(num_layers=1, num_blocks=num_blocks, tokens_per_block=bs, num_kv_heads=hkv,
                                        head_dim=d, dtype=dtype, device=torch.device("cpu"), layout="vllm-cpu",
                                        max_requests=max(b, 1), max_blocks_per_seq=per_req))
    backend = get_backend("torch")
    tr = StepTranslator(view, max_num_tokens=max(b, 16), translations=backend.required_translations)
    geometry = AttentionGeometry(kind="gqa", num_q_heads=hkv * g, num_kv_heads=hkv, head_dim=d, sm_scale=d ** -0.5)
    plan = lower_plans(PluginConfig(sparse=parse_selector_spec(args.selector)), num_layers=1, backend_name="torch")[0]
    runner = LayerRunner(layer_idx=0, geometry=geometry, plan=plan, backend=backend)
    q, k, v = (torch.randn(b, h, d, generator=gen).to(dtype) for h in (hkv * g, hkv, hkv))
    starts = torch.arange(b + 1, dtype=torch.int32)
    seq = torch.full((b,), length, dtype=torch.int32)
    block_table = torch.from_numpy(table)
    key_cache, value_cache = cache.view(num_blocks, hkv, 2 * bs, d).chunk(2, dim=2)
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=b, num_heads=hkv * g, num_kv_heads=hkv, head_dim=d, seq_lens=seq, dtype=dtype,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa="vec", enable_kv_split=False)

    def own() -> torch.Tensor:
        out = torch.empty(b, hkv * g, d, dtype=dtype)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts, seq_lens=seq,
            scale=d ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=block_table, softcap=0,
            scheduler_metadata=sched, s_aux=None)
        return out

    host = VllmHostAttention(SimpleNamespace(scale=d ** -0.5), SimpleNamespace(isa="vec", _k_scale_float=1.0,
                             _v_scale_float=1.0), q, k, v, cache, None)
    host.dense = own  # this script times decode steps only: the host's dense path is vLLM's kernel itself

    def prep() -> None:
        view.bind_layer(0, cache, *kv_views("vllm-cpu", cache))
        tr.prepare(VllmStep(starts.numpy(), seq.numpy(), table))

    prep()
    md = tr.metadata
    sel = plan.selector
    inputs = runner._inputs.selector_inputs(q, k, v, md)
    sel.on_attach(inputs, np.arange(b))  # the prompt's page summaries, as the prompt step writes them
    params = runner._select(q, k, v, md)
    tables = per_head_block_tables(params, md, view)
    q_heads = q.reshape(-1, g, d).contiguous()
    load = Path("/proc/loadavg").read_text().split()[0]
    rows = [("vLLM's own dense kernel", own), ("step: view + tables", prep),
            ("selector on_append", lambda: sel.on_append(inputs)), ("selector predict_attn", lambda: sel.predict_attn(inputs)),
            ("validate", lambda: params.validate(num_kv_heads=hkv, num_query_tokens=md.num_tokens,
                                                 num_contexts=md.num_contexts, kv_lens=md.token_kv_lens)),
            ("per-head block tables", lambda: per_head_block_tables(params, md, view)),
            ("vLLM paged kernel on them", lambda: host.paged_per_head(q_heads, tables)),
            ("plug-in layer call (all)", lambda: runner.forward(q, k, v, tr, host))]
    print(f"kv_len {length}, {b} request(s), {args.selector}; load average {load}")
    for name, fn in rows:
        print(f"  {name:28} {_median_ms(fn):8.3f} ms")
    print(f"  path taken: {runner.forward(q, k, v, tr, host).paths}")


if __name__ == "__main__":
    main()
