"""Every index-emitting selector of tests/default_selectors.py, end to end through the Engine, gives
the same layer output on the vanilla golden, the torch backend and the triton backend (interpreter on CPU).

Tolerance: fp32, rtol = atol = 2e-5. The same selector instance config runs on three engines fed
identical inputs, so prompt eviction and page summaries evolve identically.
"""
from __future__ import annotations

import pytest
import torch
from default_selectors import index_selectors

from kvsieve import Engine, KVCacheManager, KVCacheSpec, SparseAttention, SparseAttentionConfig, lower_config

HQ, HKV, D, PAGE, PROMPT = 4, 2, 16, 16, 96

SELECTORS = index_selectors()

EVICT_ONLY = {"snapkv"}  # decode reads the kept cache densely


def run(selector: str, backend: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    spec = KVCacheSpec(num_layers=1, num_blocks=40, tokens_per_block=PAGE, num_kv_heads=HKV, head_dim=D,
                       max_requests=2, max_blocks_per_seq=12)
    plan = lower_config(SparseAttentionConfig(selector, SELECTORS[selector]), num_layers=1)[0]
    layer = SparseAttention(layer_idx=0, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, plan=plan, backend=backend)
    eng = Engine(KVCacheManager(spec), [layer], max_num_requests=2, max_num_tokens=2 * PROMPT)
    outs = []
    (res,) = eng.step([0, 1], [PROMPT, PROMPT - 30], 2, [(torch.randn(2 * PROMPT - 30, HQ, D, generator=g),
                                                          torch.randn(2 * PROMPT - 30, HKV, D, generator=g),
                                                          torch.randn(2 * PROMPT - 30, HKV, D, generator=g))])
    outs.append(res.out)
    kept = res.stats.kept_after_eviction
    if selector in EVICT_ONLY:
        assert kept is not None and kept < 2 * PROMPT - 30, "the prefill must evict"
    for _ in range(2):
        (res,) = eng.step([0, 1], [1, 1], 0, [(torch.randn(2, HQ, D, generator=g), torch.randn(2, HKV, D, generator=g),
                                               torch.randn(2, HKV, D, generator=g))])
        outs.append(res.out)
        if selector not in EVICT_ONLY:
            assert res.stats.attended < res.stats.dense, "the decode step must sparsify"
    return outs


@pytest.mark.parametrize("selector", sorted(SELECTORS))
def test_selector_output_agrees_across_backends(selector):
    golden = run(selector, "vanilla")
    for backend in ("torch", "triton"):
        for step, (a, b) in enumerate(zip(run(selector, backend), golden)):
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5, msg=lambda m: f"{backend} step {step}: {m}")
