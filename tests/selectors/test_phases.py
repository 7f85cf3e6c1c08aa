"""Phases live in the metadata: for every built-in selector and every phase setting it supports, a
mixed batch (a fresh prompt next to a decode) attends densely in the phases the selector does not
run in, and exactly the placed selection in the phases it does. The bug this guards: ``streaming``
with ``phases=("generation",)`` used to give the prompt rows of a mixed batch an 8-wide selection."""
from __future__ import annotations

from itertools import combinations

import pytest
import torch

from kvsieve import Engine, KVCacheManager, KVCacheSpec, SparseAttention, SparseAttentionConfig, lower_config
from kvsieve.selectors import IndexerInputs
from kvsieve.sparse import available_selectors, get_selector_class, selection_mask
from kvsieve.sparse.backends.vanilla import masked_attention

HKV, G, D, PAGE = 2, 2, 16, 4
CONFIGS = {
    "streaming": {"budget": 8, "num_sink": 2},
    "oracle_topk": {"budget": 8},
    "block_select": {"block_size": 4, "topk_blocks": 2},
    "quest": {"budget": 8, "page_size": 4, "summary_dtype": "float32"},
    "rocketkv": {"prompt_budget": 4096, "page_size": 4, "topk": 2, "summary_dtype": "float32"},
    "snapkv": {"prompt_budget": 4096, "window_size": 4, "kernel_size": 3},
    "skip_softmax": {"threshold_scale_factor_context": 50.0, "threshold_scale_factor_generation": 50.0},
    "dsa": {"index_topk": 8, "n_heads": 2, "head_dim": 16, "rope_dim": 0},
}


def phase_settings():
    for name in sorted(CONFIGS):
        supported = sorted(get_selector_class(name).capabilities.phases)
        for n in range(1, len(supported) + 1):
            for phases in combinations(supported, n):
                yield name, phases


def test_every_builtin_selector_is_covered():
    assert set(CONFIGS) == set(available_selectors()) - {"recent_blocks"}


def _step(eng, layer, rids, lens, n_ctx, gen):
    t = sum(lens)
    extra = None
    if layer.plan.selector.name == "dsa":
        extra = IndexerInputs(q_index=torch.randn(t, 2, 16, generator=gen), k_index=torch.randn(t, 16, generator=gen),
                              weights=torch.rand(t, 2, generator=gen))
    q, k, v = (torch.randn(t, h, D, generator=gen) for h in (HKV * G, HKV, HKV))
    (res,) = eng.step(rids, lens, n_ctx, [(q, k, v)], [extra])
    return q, res


@pytest.mark.parametrize("name, phases", list(phase_settings()))
def test_mixed_batch_is_dense_outside_the_selector_phases(name, phases):
    backend = "triton" if name == "skip_softmax" else "vanilla"  # skip-softmax runs on the Triton kernels
    spec = KVCacheSpec(num_layers=1, num_blocks=64, tokens_per_block=PAGE, num_kv_heads=HKV, head_dim=D,
                       max_requests=4, max_blocks_per_seq=16)
    plan = lower_config(SparseAttentionConfig(name, CONFIGS[name], phases=phases), num_layers=1)[0]
    layer = SparseAttention(layer_idx=0, num_q_heads=HKV * G, num_kv_heads=HKV, head_dim=D, plan=plan,
                            backend=backend)
    cache = KVCacheManager(spec)
    eng = Engine(cache, [layer], max_num_requests=4, max_num_tokens=128)
    gen = torch.Generator().manual_seed(3)
    _step(eng, layer, [0], [30], 1, gen)
    q, res = _step(eng, layer, [1, 0], [26, 1], 1, gen)  # a fresh prompt (context) + a decode (generation)
    md, p = eng.metadata, res.params
    attended = 0
    for i, phase in enumerate(("context", "generation")):
        rows = md.phase_rows(phase)
        keys, values = cache.gather(0, md.request_ids[i])
        selected = p is not None and p.selects_positions(phase)
        if phase not in phases:
            assert not selected, f"{name} with phases={phases} selected positions in {phase} rows"
            assert p is None or p.threshold_scale_factor(phase) == 0.0
        mask = selection_mask(p if selected else None, rows, md.token_kv_lens, keys.shape[0], HKV)
        attended += int(mask.sum())
        ref, ref_lse = masked_attention(q[rows], keys, values, mask, layer.geometry.sm_scale)
        tol = 2e-5 if backend == "triton" else 1e-5
        if backend == "triton" and p is not None and p.threshold_scale_factor(phase) > 0:
            continue  # skip-softmax drops tiles on purpose; its own tests bound the error
        torch.testing.assert_close(res.out[rows], ref, rtol=tol, atol=tol)
        torch.testing.assert_close(res.lse[rows], ref_lse, rtol=tol, atol=tol)
    if backend == "vanilla":
        assert res.stats.attended == attended
    if name == "streaming" and phases == ("generation",):
        ctx = md.context_rows
        assert res.stats.attended > HKV * 8 * (ctx.stop - ctx.start)  # the prompt rows are dense
