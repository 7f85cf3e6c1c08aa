"""``kvsieve.apply`` with batches and beam search: the session sizes its cache on the first step,
beams follow transformers' cache reordering (shared blocks, copied on write), and what kvsieve
cannot continue (a foreign ``past_key_values``, ``generate(use_cache=False)`` under a decode-phase
selector) is refused by name with the session unchanged."""
from __future__ import annotations

import pytest
import torch
from families import build

import kvsieve
from kvsieve.integrations.transformers import KvsieveSession


def _prompts(b: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 96, (b, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_beam_search_equals_plain_transformers(family: str) -> None:
    model, ref = build(family)
    ids = _prompts(1, 20)
    kw = dict(max_new_tokens=6, num_beams=3, do_sample=False, num_return_sequences=3, early_stopping=True)
    want = ref.generate(ids, **kw)
    with kvsieve.apply(model, None) as session:
        got = model.generate(ids, **kw)
        assert session.cache.spec.max_requests == 3  # sized on the first step: one row per beam
        held = session.cache.allocator
        held.check()
    assert torch.equal(got, want)


def test_beam_search_steps_carry_the_beam_width() -> None:
    """model.generate(num_beams=k) runs its decode steps as groups of k beams (the block-offset
    table's layout); the prefill's rows are context rows, once each, and the width is 1 again after."""
    model, _ = build("llama")
    seen = []
    with kvsieve.apply(model, None) as session:
        session.observers.append(lambda i, q, result, md, layer: seen.append((md.num_contexts, md.beam_width)) if i == 0 else None)
        model.generate(_prompts(2, 10), max_new_tokens=4, num_beams=3, do_sample=False)
        assert session.beam_width == 1
    assert seen[0] == (6, 3) and seen[1:] and all(s == (0, 3) for s in seen[1:])


def test_beam_search_with_a_paged_selector_matches_dense_when_the_budget_covers_everything() -> None:
    """Quest keeps page summaries per block (an auxiliary pool): beams share them and copy them on
    write; with a budget covering every page the selection is the whole history, so the beams equal
    plain beam search."""
    model, ref = build("llama")
    ids = _prompts(2, 18, seed=3)
    kw = dict(max_new_tokens=7, num_beams=2, do_sample=False)
    want = ref.generate(ids, **kw)
    with kvsieve.apply(model, "quest", budget=64, page_size=4, summary_dtype="float32") as session:
        got = model.generate(ids, **kw)
        assert session.cache.aux_pools, "quest's page summaries live beside the blocks"
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_batch_of_two_equals_two_single_runs_and_plain(family: str) -> None:
    model, ref = build(family)
    ids = _prompts(2, 24, seed=1)
    want = ref.generate(ids, max_new_tokens=5, do_sample=False)
    with kvsieve.apply(model, None):
        assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False), want)
    with kvsieve.apply(model, "oracle_topk", budget=6):
        batch = model.generate(ids, max_new_tokens=5, do_sample=False)
        singles = torch.cat([model.generate(ids[i: i + 1], max_new_tokens=5, do_sample=False) for i in range(2)])
    assert torch.equal(batch, singles)


def test_session_generate_batch_equals_single_rows() -> None:
    model, _ = build("qwen3")
    ids = _prompts(3, 16, seed=2)
    cfg = kvsieve.SparseAttentionConfig("oracle_topk", {"budget": 5}, phases=("generation",))
    with KvsieveSession(model, cfg, max_tokens=64) as session:
        batch = session.generate(ids, max_new_tokens=4)
        singles = torch.cat([session.generate(ids[i: i + 1], max_new_tokens=4) for i in range(3)])
    assert torch.equal(batch, singles)


def test_max_batch_still_bounds_the_rows() -> None:
    model, _ = build("llama")
    with KvsieveSession(model, None, max_tokens=64, max_batch=1) as session:
        with pytest.raises(ValueError, match="max_batch=1"):
            session.generate(_prompts(2, 8), max_new_tokens=2)
        assert session.cache.request_ids == []


def test_a_foreign_past_key_values_is_refused_by_name() -> None:
    model, ref = build("llama")
    ids = _prompts(1, 12)
    out = ref.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    foreign = out.cache
    more = torch.cat([out.sequences, _prompts(1, 1, seed=9)], dim=1)
    with kvsieve.apply(model, None) as session:
        model.generate(ids, max_new_tokens=2, do_sample=False)  # the session's own generation
        before = (session.num_cached_positions, session.cache.valid_len(0))
        with pytest.raises(ValueError, match=r"cache \(past_key_values\): a DynamicCache holding 14 positions"):
            model.generate(more, cache=foreign, max_new_tokens=2, do_sample=False)
        assert (session.num_cached_positions, session.cache.valid_len(0)) == before


def test_generate_without_cache_under_a_decode_selector_is_refused() -> None:
    model, ref = build("llama")
    ids = _prompts(1, 12)
    with kvsieve.apply(model, None):  # dense: every step a prefill is exact
        assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False, use_cache=False),
                           ref.generate(ids, max_new_tokens=3, do_sample=False))
    with kvsieve.apply(model, "oracle_topk", budget=4) as session:
        with pytest.raises(ValueError, match=r"use_cache=False.*\['oracle_topk'\]"):
            model.generate(ids, max_new_tokens=3, do_sample=False, use_cache=False)
        assert session.num_cached_positions == 12  # the refused step changed nothing
