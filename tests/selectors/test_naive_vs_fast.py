"""Each fast path against its per-request naive reference: identical on tie-free inputs, overlapping on ties."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from harness import Harness, overlap, reference_params, selection_sets
from kvsieve.sparse.selector_step import place_rows

PROMPTS = [300, 170, 41]  # one below every prompt budget used here


def _ties(n: int, hkv: int, g: int, d: int, gen: torch.Generator):
    """Integer-valued q/k in {-1, 0, 1}: many exactly equal scores."""
    q = torch.randint(-1, 2, (n, hkv * g, d), generator=gen).float()
    k = torch.randint(-1, 2, (n, hkv, d), generator=gen).float()
    return q, k, torch.randn(n, hkv, d, generator=gen)


def _data(h: Harness, n: int, gen: torch.Generator, ties: bool):
    return _ties(n, h.hkv, h.g, h.d, gen) if ties else h.qkv(n, gen)


def _equal_or_overlap(a, b, num_tokens, hkv, ties, threshold):
    assert a.selected_phases == b.selected_phases
    if ties:
        assert overlap(selection_sets(a, num_tokens, hkv), selection_sets(b, num_tokens, hkv)) >= threshold
    else:  # the same units per (row, KV head); a row may carry -1 padding in one and not the other
        assert selection_sets(a, num_tokens, hkv) == selection_sets(b, num_tokens, hkv)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("name, params", [
    ("rocketkv", {"prompt_budget": 128, "window_size": 16, "kernel_size": 7}),
    ("snapkv", {"prompt_budget": 96, "window_size": 32, "kernel_size": 7}),
])
def test_prompt_eviction(name, params, ties):
    h = Harness(name, params, hkv=2, g=3, d=32)
    gen = torch.Generator().manual_seed(1)
    q, k, v = _data(h, sum(PROMPTS), gen, ties)
    inputs = h.hook_inputs([1, 2, 3], PROMPTS, 3, q, k, v)
    fast, gold = h.selector.predict_kv(inputs), h.selector.predict_kv_naive(inputs)
    assert torch.equal(fast[1], gold[1])
    budget = params["prompt_budget"]
    assert fast[1].tolist() == [0, budget, 2 * budget, 2 * budget + PROMPTS[2]]
    if ties:
        same = (fast[0].unsqueeze(-1) == gold[0].unsqueeze(-2)).any(-1).float().mean()
        assert same >= 0.98
    else:
        assert torch.equal(fast[0], gold[0])


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("name, params", [
    ("rocketkv", {"prompt_budget": 4096, "page_size": 4, "topk": 12}),
    ("rocketkv", {"prompt_budget": 4096, "page_size": 8, "topk": 6, "topr": 12, "summary_dtype": "bfloat16"}),
    ("quest", {"budget": 64, "page_size": 16}),
    ("quest", {"budget": 32, "page_size": 8, "summary_dtype": "float8_e5m2"}),
    ("block_select", {"block_size": 16, "topk_blocks": 5, "init_blocks": 1}),
    ("block_select", {"block_size": 32, "topk_blocks": 3, "score_type": "mean"}),
    ("block_select", {"block_size": 32, "topk_blocks": 3, "local_blocks": 0, "scoring": "summary"}),  # 2 pages/block
    ("block_select", {"block_size": 8, "topk_blocks": 6, "init_blocks": 1, "scoring": "summary"}),  # a block < a cache block
])
def test_attention_selection(name, params, ties):
    """Prefill step (no answer from page selectors), decode step, then a mixed context+decode step
    (page selectors answer for the generation rows only; context rows are outside ``selected_phases``)."""
    h = Harness(name, params, hkv=2, g=4, d=32)
    gen = torch.Generator().manual_seed(2)
    q, k, v = _data(h, sum(PROMPTS), gen, ties)
    inputs = h.hook_inputs([1, 2, 3], PROMPTS, 3, q, k, v)
    fast, gold = h.selector.predict_attn(inputs), h.selector.predict_attn_naive(inputs)
    if name == "block_select":
        _equal_or_overlap(fast, gold, sum(PROMPTS), h.hkv, ties, 0.98)
    else:
        assert fast is None and gold is None  # decode-time selectors leave a pure prefill dense
    h.engine.end_step()
    for rids, lens, ctx in (([1, 2, 3], [1, 1, 1], 0), ([4, 1, 3], [57, 1, 1], 1)):
        q, k, v = _data(h, sum(lens), gen, ties)
        inputs = h.hook_inputs(rids, lens, ctx, q, k, v)
        fast = place_rows(h.selector.predict_attn(inputs), inputs, name)
        gold = reference_params(h.selector, inputs)
        fast.validate(num_kv_heads=h.hkv, num_query_tokens=sum(lens), kv_lens=inputs.metadata.token_kv_lens)
        if name != "block_select":
            assert fast.selected_phases == {"generation"}
            assert fast.sparse_attn_offsets[: sum(lens[:ctx]) + 1].eq(0).all()  # context rows: empty
        _equal_or_overlap(fast, gold, sum(lens), h.hkv, ties, 0.94)
        h.engine.end_step()


@pytest.mark.parametrize("params", [
    {"block_size": 16, "topk_blocks": 5, "init_blocks": 1},
    {"block_size": 32, "topk_blocks": 3, "score_type": "mean"},
    {"block_size": 8, "topk_blocks": 6, "init_blocks": 1, "scoring": "summary"},
    {"block_size": 16, "topk_blocks": 8, "scoring": "summary", "top_p": 0.6},
])
def test_block_select_chunks_score_the_blocks_they_see(params, monkeypatch):
    """With chunks of 37 rows (so each prompt's rows span chunks that see 3 to 19 blocks, fewer than
    ``topk_blocks`` in the first) the fast path still picks what the naive reference does."""
    from kvsieve.selectors.block_select import selector as block_select

    monkeypatch.setattr(block_select, "_CHUNK_ROWS", 37)
    h = Harness("block_select", params, hkv=2, g=4, d=32)
    gen = torch.Generator().manual_seed(5)
    q, k, v = h.qkv(sum(PROMPTS), gen)
    inputs = h.hook_inputs([1, 2, 3], PROMPTS, 3, q, k, v)
    fast, gold = h.selector.predict_attn(inputs), h.selector.predict_attn_naive(inputs)
    _equal_or_overlap(fast, gold, sum(PROMPTS), h.hkv, False, 1.0)


def test_page_prefix_is_each_rows_page_up_to_itself():
    """:meth:`PageSummaries.prefix` for a prompt's rows (sharing pages), a later chunk's and one
    decode row, in one call (the running min/max), and for rows each on a page of its own (the
    masked reduction): each row's page min/max over the positions up to it, from the cache."""
    h = Harness("quest", {"budget": 32, "page_size": 8, "summary_dtype": "bfloat16"}, tpb=16)
    gen = torch.Generator().manual_seed(6)
    for rids, lens, ctx in (([1], [29], 1), ([2, 1], [13, 1], 1)):
        q, k, v = h.qkv(sum(lens), gen)
        inputs = h.hook_inputs(rids, lens, ctx, q, k, v)
        h.engine.end_step()
    for rids, positions in (([1] * 30 + [2] * 13, list(range(30)) + list(range(13))),
                            ([1, 2, 1, 1], [29, 12, 3, 21])):  # shared pages; then a page a row
        kmin, kmax = h.selector.summaries(inputs).prefix(0, h.cache.slots(rids), np.array(positions))
        for i, (rid, p) in enumerate(zip(rids, positions)):
            keys = h.cache.gather(0, rid)[0][p // 8 * 8: p + 1]
            assert torch.equal(kmin[i], keys.amin(0).to(torch.bfloat16).float())
            assert torch.equal(kmax[i], keys.amax(0).to(torch.bfloat16).float())


@pytest.mark.parametrize("summary_dtype", ["float32", "bfloat16"])
def test_page_summaries_match_the_cache(summary_dtype):
    """After appends across page and block boundaries (a prompt, then one-token decode steps, each
    refreshing its page with the native min/max kernel, one of them opening a new page) the aux
    pool holds min/max of the cached keys, rounded to the summary dtype."""
    h = Harness("quest", {"budget": 32, "page_size": 8, "summary_dtype": summary_dtype}, tpb=16)
    dtype = getattr(torch, summary_dtype)
    gen = torch.Generator().manual_seed(3)
    for lens, ctx in (([21], 1), ([1], 0), ([1], 0), ([1], 0), ([1], 0), ([11], 1)):
        rid = 1 if ctx == 0 or lens == [21] else 2
        q, k, v = h.qkv(lens[0], gen)
        inputs = h.hook_inputs([rid], lens, ctx, q, k, v)
        h.engine.end_step()
    summaries = h.selector.summaries(inputs)
    for rid in (1, 2):
        keys, _ = h.cache.gather(0, rid)
        slot = h.cache.slot(rid)
        kmin, kmax = summaries.read(0, h.cache.slots([rid]), h.cache.valid_lens[[slot]])
        for p in range(-(-keys.shape[0] // 8)):
            assert torch.equal(kmin[0, p], keys[p * 8: (p + 1) * 8].amin(0).to(dtype).float())
            assert torch.equal(kmax[0, p], keys[p * 8: (p + 1) * 8].amax(0).to(dtype).float())


def test_page_summaries_read_through_both_paths():
    """A request whose blocks are not contiguous (another request took the block after its second)
    is read through the block gather, a contiguous one through the pool slice, and both together
    through the gather: each against the min/max of its cached keys."""
    h = Harness("quest", {"budget": 32, "page_size": 8, "summary_dtype": "float32"}, tpb=16)
    gen = torch.Generator().manual_seed(4)
    steps = [([1], [21], 1), ([2], [11], 1)] + [([1], [1], 0)] * 12
    for rids, lens, ctx in steps:
        q, k, v = h.qkv(lens[0], gen)
        inputs = h.hook_inputs(rids, lens, ctx, q, k, v)
        h.engine.end_step()
    assert h.cache.block_ids(1) == [1, 2, 4] and h.cache.block_ids(2) == [3]
    summaries = h.selector.summaries(inputs)
    for rids in ([1], [2], [1, 2]):
        slots = h.cache.slots(rids)
        kmin, kmax = summaries.read(0, slots, h.cache.valid_lens[slots])
        for b, rid in enumerate(rids):
            keys, _ = h.cache.gather(0, rid)
            for p in range(-(-keys.shape[0] // 8)):
                assert torch.equal(kmin[b, p], keys[p * 8: (p + 1) * 8].amin(0))
                assert torch.equal(kmax[b, p], keys[p * 8: (p + 1) * 8].amax(0))


@pytest.mark.parametrize("name, params, tpb", [
    ("quest", {"budget": 64, "page_size": 16}, 16),
    ("quest", {"budget": 48, "page_size": 8, "summary_dtype": "float8_e5m2"}, 32),  # 4 pages per block
    ("rocketkv", {"prompt_budget": 4096, "page_size": 8, "topk": 6, "topr": 12, "summary_dtype": "bfloat16"}, 16),
])
def test_one_request_decode_takes_the_short_path(name, params, tpb, monkeypatch):
    """A step whose generation rows are one token per request (alone, then behind another
    request's prefill rows) takes the per-row path of ``select_pages`` and refreshes its one
    page in place (one page to ``page_minmax``), and still equals the naive reference, across page and
    block boundaries."""
    from kvsieve.selectors.common import page_summary as _page_summary

    calls = {"select": [], "refresh": []}

    def counting(owner, attr, key, record):
        orig = getattr(owner, attr)

        def counted(*args, **kwargs):
            calls[key].append(record(*args))
            return orig(*args, **kwargs)
        monkeypatch.setattr(owner, attr, counted)

    counting(_page_summary, "_select_pages_per_row", "select", lambda *a: 1)
    counting(_page_summary, "page_minmax", "refresh", lambda keys, blocks, *a: len(blocks))  # pages refreshed
    h = Harness(name, params, hkv=2, g=3, d=32, tpb=tpb)
    gen = torch.Generator().manual_seed(5)
    q, k, v = h.qkv(200, gen)
    h.hook_inputs([1], [200], 1, q, k, v)
    h.engine.end_step()
    steps = [([1], [1], 0)] * 20 + [([2, 1], [57, 1], 1)]
    for rids, lens, ctx in steps:
        q, k, v = h.qkv(sum(lens), gen)
        inputs = h.hook_inputs(rids, lens, ctx, q, k, v)
        fast = place_rows(h.selector.predict_attn(inputs), inputs, name)
        fast.validate(num_kv_heads=h.hkv, num_query_tokens=sum(lens), kv_lens=inputs.metadata.token_kv_lens)
        _equal_or_overlap(fast, reference_params(h.selector, inputs), sum(lens), h.hkv, False, 1.0)
        h.engine.end_step()
    assert len(calls["select"]) == len(steps)
    assert calls["refresh"][1:21] == [1] * 20  # after the prompt's pages, each decode step its one page
