"""Per-stage time of one attention layer of the vLLM plug-in on CPU, one decode token per request,
against vLLM's own kernel on the same cache (the profile behind docs/results/vllm.md).

    python benchmarks/vllm_cpu_layer.py [--kv-len 8000] [--requests 1] [--block-size 128]
                                        [--selector quest:budget=256,page_size=128]

Runs in the vLLM virtual environment, one torch thread. SmolLM2-135M's attention geometry (3 KV
heads, 3 query heads each, head dim 64), bf16, vLLM's ``vec`` CPU layout with ``--block-size`` blocks,
random K/V; the selector's page summaries are built once (as the prompt step would). Each stage is
timed alone (200 calls, warm; median and minimum): vLLM's own dense kernel; the step's view and
tables; the selector (``on_append``, ``predict_attn``, ``validate``); for a selection of whole vLLM
blocks the per-(row, KV head) block tables and vLLM's paged kernel on them, for any other selection
(tokens: ``oracle_topk``, ``streaming``) the per-(row, KV head) runs, kvsieve's native kernel on
them, and the kvsieve backend's attention on the same selection (what ran before); the whole
plug-in layer call (``LayerRunner.forward`` with vLLM's kernels); and the same call without them
(the kvsieve backend's path, which token selections took before ``native_runs``).
Prints milliseconds and the load average.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repo's benchmarks package
from benchmarks._timing import cpu_isa  # noqa: E402


def _times_ms(fn, n: int = 200) -> tuple[float, float]:  # noqa: ANN001
    """(median, minimum) milliseconds of ``n`` warm calls."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), 1e3 * min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-len", type=int, default=8000)
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=128, help="vLLM's KV block size (a multiple of 32)")
    ap.add_argument("--selector", default="quest:budget=256,page_size=128")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    from vllm import _custom_ops as ops
    from vllm.config import set_current_vllm_config

    from kvsieve.integrations.vllm import cpu as plugin_cpu
    from kvsieve.integrations.vllm.config import ENV_SELECTOR, WorkerRanks
    from kvsieve.integrations.vllm.cpu import KvsieveCPUAttentionImpl, VllmHostAttention
    from kvsieve.integrations.vllm.host import native_runs_attention, per_head_block_tables, token_runs
    from kvsieve.integrations.vllm.layouts import kv_views
    from kvsieve.integrations.vllm.state import plugin_state
    from kvsieve.integrations.vllm.step import PreparedStep, VllmStep
    from kvsieve.selectors.dsa import IndexerInputs
    from kvsieve.sparse.selector_step import selector_inputs

    hkv, g, d, bs, b, length = 3, 3, 64, args.block_size, args.requests, args.kv_len
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    per_req = -(-length // bs)
    num_blocks = per_req * b + 1
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(num_blocks, hkv, bs, 2 * d, generator=gen).to(dtype)
    table = np.arange(1, 1 + per_req * b, dtype=np.int32).reshape(b, per_req)
    # the plug-in's per-process state, as vLLM's first attention layer builds it (the config from the
    # environment; vLLM's config as the plain attributes the state reads; one worker)
    os.environ[ENV_SELECTOR] = args.selector
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=per_req * bs, dtype=dtype,
                                     hf_config=SimpleNamespace(num_hidden_layers=1, hidden_size=576)),
        compilation_config=SimpleNamespace(mode=0),  # eager, as a selector reading the hidden state needs
        scheduler_config=SimpleNamespace(max_num_seqs=max(b, 1), max_num_batched_tokens=max(b, 16)),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1))
    state = plugin_state(vllm_config, torch.device("cpu"), WorkerRanks())
    plugin_cpu.worker_ranks = WorkerRanks  # the impl asks vLLM's distributed state, not set up here: one worker
    with set_current_vllm_config(vllm_config):  # what vLLM's impl reads of it: model_config.dtype
        impl = KvsieveCPUAttentionImpl(hkv * g, d, d ** -0.5, hkv, None, None, "auto")
    tr = state.translator("vllm-cpu", cache, kv_views("vllm-cpu", cache)[0])
    view, backend = tr.view, state.backend
    runner = state.runner(0, impl.geometry)
    plan, geometry = runner.plan, runner.geometry
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

    step = VllmStep(starts.numpy(), seq.numpy(), table, prompt_lens=seq.numpy() - 1)  # decode rows

    def prep() -> PreparedStep:
        view.bind_layer(0, cache, *kv_views("vllm-cpu", cache))
        return tr.prepare(VllmStep(step.query_start_loc, step.seq_lens, step.block_table, step.prompt_lens))

    prepared = prep()
    md = prepared.metadata
    # the native decode path (one foreign call per layer), built first: it creates the selector's pools
    native = state.decode_path(0, "vllm-cpu", cache, impl.geometry)
    if plan.selector.model_inputs_type is not None:  # the prompt's index keys, as its prefill writes them
        for pool in view.aux_pools.values():         # (random, like the cache)
            pool[0].copy_(torch.randn(pool[0].shape, generator=gen).to(pool[0].dtype))
    sel = plan.selector
    fed = None  # a selector reading the layer's hidden state (dsa): a random one, of its projections' size
    if plan.selector.model_inputs_type is IndexerInputs:
        fed = IndexerInputs(hidden=torch.randn(b, plan.selector.projections[0].hidden_size, generator=gen).to(dtype))
    inputs = selector_inputs(q, k, v, md, layer_idx=0, geometry=geometry, plan=plan, model_inputs=fed)
    sel.on_attach(inputs, np.arange(b))  # the prompt's page summaries, as the prompt step writes them
    params = runner.select(q, k, v, md, fed)
    tables = per_head_block_tables(params, md, view)
    q_heads = q.reshape(-1, g, d).contiguous()
    if tables is not None:  # whole vLLM blocks: vLLM's paged kernel
        selected = [("per-head block tables", lambda: per_head_block_tables(params, md, view)),
                    ("vLLM paged kernel on them", lambda: host.paged_per_head(q_heads, tables))]
    else:  # any other selection: kvsieve's native kernel on runs
        runs = token_runs(params, md, view)
        selected = [("per-head token runs", lambda: token_runs(params, md, view)),
                    ("native kernel on the runs", lambda: native_runs_attention(q, runs, view, 0, geometry)),
                    ("kvsieve backend on it", lambda: backend.forward(q, md, 0, geometry, params))]
    # the native path through the plug-in's forward as vLLM calls it, and its foreign call alone
    # (selection + attention)
    native_rows = []
    out_native = torch.empty(b, hkv * g, d, dtype=dtype)
    if native is not None and native.reads_model_inputs:  # dsa: the call vLLM's forward makes after taking the hidden state
        native_rows = [("plug-in decode call, native", lambda: native.run(step.block_table, step.seq_lens,
                                                                          step.positions, q, out_native, fed))]
    elif native is not None:
        md_native = SimpleNamespace(num_actual_tokens=b, causal=True, dynamic_causal=None, step=step)
        layer = SimpleNamespace(layer_name="model.layers.0.self_attn.attn")
        out_flat = torch.empty(b, hkv * g * d, dtype=dtype)
        native_rows = [("plug-in decode call, native", lambda: impl.forward(layer, q, k, v, cache, md_native, out_flat))]
    if native_rows:
        native_rows[0][1]()
        call, index = native.call, None
        if native.reads_model_inputs:  # the forward's index inputs are freed after it: the call with its own
            def index_inputs():  # noqa: ANN202
                return native.selector.decode_step_inputs(native.layer_idx, fed, step.positions)
            index = index_inputs()
            native_rows.append(("  the indexer's inputs (torch)", index_inputs))
        # the public call with the step's tables (its argument packing is a few attribute writes)
        native_rows.append(("  its foreign call alone", lambda: call.run(step.block_table, step.seq_lens, q, out_native,
                                                                         index)))
    load = Path("/proc/loadavg").read_text().split()[0]
    rows = [("vLLM's own dense kernel", own), ("step: view + tables", prep),
            ("selector on_append", lambda: sel.on_append(inputs)), ("selector predict_attn", lambda: sel.predict_attn(inputs)),
            ("validate", lambda: params.validate(num_kv_heads=hkv, num_query_tokens=md.num_tokens,
                                                 num_contexts=md.num_contexts, kv_lens=md.token_kv_lens)),
            *selected, ("plug-in layer call, Python", lambda: runner.forward(q, k, v, prepared, host, model_inputs=fed)),
            ("same, kvsieve backend path", lambda: runner.forward(q, k, v, prepared, None, model_inputs=fed)), *native_rows]
    print(f"kv_len {length}, {b} request(s), {args.selector}, {args.dtype}; CPU {cpu_isa()}; load average {load}")
    print(f"  {'stage':30} {'median':>8}    {'min':>8}")
    times = {}
    for name, fn in rows:
        times[name] = _times_ms(fn)
        print(f"  {name:30} {times[name][0]:8.3f} ms {times[name][1]:8.3f} ms")
    if native_rows:
        host_us = [1e3 * (x - y) for x, y in zip(times["plug-in decode call, native"], times["  its foreign call alone"])]
        what = " (with the indexer's projections in torch)" if fed is not None else ""
        print(f"  host work of the native path per layer{what}: {host_us[0]:.1f} us (medians), {host_us[1]:.1f} us (minima)")
    else:
        print("  no native decode path for this selector here (see kvsieve/integrations/vllm/native_decode.py)")
    paths = runner.forward(q, k, v, prepared, host, model_inputs=fed)
    print(f"  paths taken: {paths.paths} (kvsieve backend: "
          f"{runner.forward(q, k, v, prepared, None, model_inputs=fed).paths}); positions read {int(paths.attended.sum())}"
          f" of {b * length * hkv}; load average after {Path('/proc/loadavg').read_text().split()[0]}")


if __name__ == "__main__":
    with torch.inference_mode():  # as vLLM runs its forward
        main()
