"""Full layer (Engine + SparseAttention, vanilla backend) against masked_attention on the expected
mask; RocketKV end to end (eviction, compaction, summaries after compaction); sparsification."""
from __future__ import annotations

import pytest
import torch

from harness import Harness, expected_output, reference_params
from kvsieve.sparse.backends.vanilla import masked_attention

SCALE = 32 ** -0.5


@pytest.mark.parametrize("name, params", [
    ("quest", {"budget": 32, "page_size": 8}),
    ("rocketkv", {"prompt_budget": 4096, "page_size": 4, "topk": 8}),
    ("block_select", {"block_size": 16, "topk_blocks": 3}),
    ("block_select", {"block_size": 16, "topk_blocks": 3, "score_type": "mean"}),
])
def test_layer_output_matches_vanilla_over_the_naive_selection(name, params):
    h = Harness(name, params, hkv=2, g=2, d=32)
    gen = torch.Generator().manual_seed(4)
    for rids, lens, ctx in (([1, 2], [150, 90], 2), ([3, 1, 2], [40, 1, 1], 1), ([1, 2], [1, 1], 0)):
        q, k, v = h.qkv(sum(lens), gen)
        md = h.engine.begin_step(rids, lens, ctx)
        res = h.layers[0].forward(q, k, v, md)
        out, lse = res.out, res.lse
        naive = reference_params(h.selector, h.layers[0].selector_inputs(q, k, v, md))  # None = dense
        starts = md.query_start_host
        for i, rid in enumerate(rids):
            keys, values = h.cache.gather(0, rid)
            rows = slice(int(starts[i]), int(starts[i + 1]))
            phase = "context" if i < ctx else "generation"
            ref_out, ref_lse = expected_output(q, keys, values, naive, md, rows, keys.shape[0], h.hkv, SCALE, phase)
            torch.testing.assert_close(out[rows], ref_out, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse[rows], ref_lse, rtol=1e-5, atol=1e-5)
        h.engine.end_step()


def test_rocketkv_end_to_end():
    budget, window, page = 96, 16, 4
    params = {"prompt_budget": budget, "window_size": window, "kernel_size": 7, "page_size": page, "topk": 6,
              "summary_dtype": "float32"}
    h = Harness("rocketkv", params, hkv=2, g=2, d=32, tpb=16, num_layers=2)
    gen = torch.Generator().manual_seed(5)
    lens = [300, 50]  # the second prompt is shorter than the budget: kept whole
    qkv = [h.qkv(sum(lens), gen) for _ in h.layers]
    md = h.engine.begin_step([1, 2], lens, 2)
    before = [(k[:300], v[:300]) for _, k, v in qkv]  # request 1's prompt K/V as written by each layer
    outs = []
    for i, layer in enumerate(h.layers):
        outs.append(layer.forward(*qkv[i], md))
        stats = outs[i].stats
        # prefill attention stays dense over the whole prompt
        k_full, v_full = before[i]
        causal = torch.arange(300).unsqueeze(0) <= torch.arange(300).unsqueeze(1)
        ref, _ = masked_attention(qkv[i][0][:300], k_full, v_full, causal.expand(2, 300, 300), SCALE)
        torch.testing.assert_close(outs[i].out[:300], ref, rtol=1e-5, atol=1e-5)
        assert stats.kept_after_eviction == budget + 50
    assert h.engine.end_step() == {1: budget, 2: 50}
    assert h.cache.valid_len(1) == budget and h.cache.valid_len(2) == 50
    for i, layer in enumerate(h.layers):
        kept = outs[i].params.sparse_kv_indices[:, :budget].to(torch.int64)  # request 1, head-major
        assert kept.shape == (2, budget) and bool((kept[:, -window:] == torch.arange(300 - window, 300)).all())
        k_now, v_now = h.cache.gather(i, 1)
        for hd in range(2):
            assert torch.equal(k_now[:, hd], before[i][0][kept[hd], hd])
            assert torch.equal(v_now[:, hd], before[i][1][kept[hd], hd])
    for step in range(6):  # decode on the compacted cache; summaries follow it
        md = h.engine.begin_step([1, 2], [1, 1], 0)
        for i, layer in enumerate(h.layers):
            q, k, v = h.qkv(2, gen)
            res = layer.forward(q, k, v, md)
            out = res.out
            inputs = layer.selector_inputs(q, k, v, md)
            naive = reference_params(h.selector, inputs)
            assert torch.equal(res.params.sparse_attn_indices, naive.sparse_attn_indices)
            keys, values = h.cache.gather(i, 1)
            assert keys.shape[0] == budget + step + 1
            slots = h.cache.slots([1])
            kmin, kmax = h.selector.summaries(inputs).read(i, slots, h.cache.valid_lens[slots])
            pages = [keys[p: p + page] for p in range(0, keys.shape[0], page)]
            assert torch.equal(kmin[0, : len(pages)], torch.stack([x.amin(0) for x in pages]))
            assert torch.equal(kmax[0, : len(pages)], torch.stack([x.amax(0) for x in pages]))
            ref, _ = expected_output(q, keys, values, naive, md, slice(0, 1), keys.shape[0], 2, SCALE)
            torch.testing.assert_close(out[:1], ref, rtol=1e-5, atol=1e-5)
        h.engine.end_step()


@pytest.mark.parametrize("name, params, promised", [
    ("quest", {"budget": 64, "page_size": 16}, 64),
    ("rocketkv", {"prompt_budget": 4096, "page_size": 4, "topk": 16}, 64),
    ("block_select", {"block_size": 16, "topk_blocks": 4}, 64),
])
def test_decode_sparsifies(name, params, promised):
    """Attended positions per (query, KV head) never exceed the budget the config promises."""
    h = Harness(name, params, hkv=2, g=2, d=32)
    gen = torch.Generator().manual_seed(6)
    h.engine.step([1, 2], [700, 500], 2, [h.qkv(1200, gen)])
    (res,) = h.engine.step([1, 2], [1, 1], 0, [h.qkv(2, gen)])
    stats = res.stats
    assert stats.attended <= promised * 2 * 2
    assert stats.attended_fraction < promised / 500


def test_block_select_prefill_sparsifies():
    h = Harness("block_select", {"block_size": 16, "topk_blocks": 4}, hkv=2, g=2, d=32)
    gen = torch.Generator().manual_seed(7)
    (res,) = h.engine.step([1], [800], 1, [h.qkv(800, gen)])
    stats = res.stats
    assert stats.attended <= 800 * 2 * 64 and stats.attended_fraction < 64 / 400


@pytest.mark.parametrize("name", ["snapkv", "rocketkv"])
def test_eviction_sparsifies(name):
    h = Harness(name, {"prompt_budget": 128}, hkv=2, g=2, d=32)
    gen = torch.Generator().manual_seed(8)
    (res,) = h.engine.step([1], [1000], 1, [h.qkv(1000, gen)])
    assert res.stats.kept_after_eviction == 128  # kept positions per KV head
    assert h.cache.valid_len(1) == 128 < 1000
