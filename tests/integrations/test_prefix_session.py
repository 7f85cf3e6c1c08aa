"""Prefix caching through the session users hold: a prompt sharing whole cached blocks with an
earlier one holds them by reference and the model runs on the rest only; the tokens equal a
session without prefix caching and the logits agree to 1e-5; what the session cannot honour is
refused by name."""
from __future__ import annotations

import pytest
import torch
from families import build

import kvsieve
from kvsieve.integrations.transformers import KvsieveSession

SYSTEM = torch.randint(3, 96, (1, 21), generator=torch.Generator().manual_seed(7))  # 5 whole blocks of 4, and 1


def _prompt(seed: int, n: int = 9) -> torch.Tensor:
    return torch.cat([SYSTEM, torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(seed))], 1)


def _model_rows(model: torch.nn.Module) -> list[int]:
    """Records the number of positions each model forward runs on."""
    seen: list[int] = []
    model.register_forward_pre_hook(lambda m, args, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
    return seen


@pytest.mark.parametrize("selector", [None, "quest"])
def test_a_second_prompt_reuses_the_cached_prefix_and_matches_no_sharing(selector):
    cfg = None if selector is None else kvsieve.SparseAttentionConfig(
        "quest", {"budget": 8, "page_size": 4, "summary_dtype": "float32"}, phases=("generation",))
    model, _ = build("llama")
    want = []
    with KvsieveSession(model, cfg, max_tokens=64, tokens_per_block=4) as plain:
        for seed in (1, 2):
            logits = plain.prefill(_prompt(seed))
            want.append((logits, plain.continue_greedy(logits, 5)))
    rows = _model_rows(model)
    with KvsieveSession(model, cfg, max_tokens=64, tokens_per_block=4, prefix_caching=True) as session:
        got = []
        for seed in (1, 2):
            logits = session.prefill(_prompt(seed))
            got.append((logits, session.continue_greedy(logits, 5)))
            if seed == 1:
                first = session.cache.block_ids(0)[:5]
        assert session.cache.block_ids(0)[:5] == first  # the system prompt's 5 whole blocks, reused
        session.cache.allocator.check()
    assert rows[0] == 30 and rows[5] == 30 - 20  # the first prompt in full; the second past 20 cached positions
    for (lw, tw), (lg, tg) in zip(want, got):
        assert torch.equal(tg, tw)
        # not bit-identical: the rest runs as a 10-row step over cached keys, the plain run as 30 rows
        # (CPU GEMM and SDPA sum in a shape-dependent order)
        torch.testing.assert_close(lg, lw, rtol=0, atol=1e-5)


def test_a_batch_reuses_what_every_row_shares_and_a_new_config_forgets_the_cache():
    model, _ = build("llama")
    rows = _model_rows(model)
    with KvsieveSession(model, None, max_tokens=64, max_batch=2, tokens_per_block=4, prefix_caching=True) as session:
        session.prefill(_prompt(1))
        other = torch.randint(3, 96, (1, 21), generator=torch.Generator().manual_seed(3))
        batch = torch.cat([_prompt(2), torch.cat([SYSTEM[:, :9], other], 1)])  # row 1 shares 2 whole blocks only
        session.prefill(batch)
        assert rows[-1] == 30 - 8
        session.set_config(None)  # the cached blocks were computed under the old plans
        assert session.cache.allocator.num_cached == 0
        session.prefill(_prompt(1))
        assert rows[-1] == 30


@pytest.mark.parametrize("selector", [None, "quest"])
def test_a_wider_batch_grows_the_cache_and_keeps_the_prefix_cache(selector):
    cfg = None if selector is None else kvsieve.SparseAttentionConfig(
        "quest", {"budget": 8, "page_size": 4, "summary_dtype": "float32"}, phases=("generation",))
    model, _ = build("llama")
    batch = torch.cat([_prompt(2), _prompt(3)])
    with KvsieveSession(model, cfg, max_tokens=64, tokens_per_block=4) as plain:
        plain.prefill(_prompt(1))
        want = plain.prefill(batch)
        want_tokens = plain.continue_greedy(want, 5)
    rows = _model_rows(model)
    with KvsieveSession(model, cfg, max_tokens=64, tokens_per_block=4, prefix_caching=True) as session:
        session.prefill(_prompt(1))
        cached = session.cache.allocator.num_cached
        first = session.cache.block_ids(0)[:5]
        got = session.prefill(batch)  # 2 rows: the session outgrows its 1-row cache and rebuilds it
        assert session.cache.spec.max_requests == 2
        assert session.cache.block_ids(0)[:5] == session.cache.block_ids(1)[:5] == first  # moved, and shared
        got_tokens = session.continue_greedy(got, 5)
        session.cache.allocator.check()
        assert cached == 7  # the first prompt's 7 whole blocks were named before the rebuild
    assert rows[1] == 30 - 20  # both rows past the system prompt's 5 cached blocks
    assert torch.equal(got_tokens, want_tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_adopting_a_prefix_cache_checks_both_caches():
    from kvsieve.metadata import KVCacheManager, KVCacheSpec
    spec = dict(num_layers=1, num_kv_heads=1, head_dim=4, tokens_per_block=2, max_blocks_per_seq=4)
    old = KVCacheManager(KVCacheSpec(num_blocks=5, max_requests=1, **spec))
    old.add_request(0, tokens=[1, 2, 3, 4])
    old.append_tokens(0, 4, tokens=[1, 2, 3, 4])
    old.pools[0][1:3] = 1.0
    old.cache_full_blocks([0])
    new = KVCacheManager(KVCacheSpec(num_blocks=9, max_requests=2, **spec))
    with pytest.raises(ValueError, match="no live requests"):
        new.adopt_cached(old)  # request 0 still holds its blocks
    assert new.allocator.num_cached == 0
    old.free_request(0)
    small = KVCacheManager(KVCacheSpec(num_blocks=3, max_requests=1, **spec))
    with pytest.raises(ValueError, match="does not fit"):
        small.adopt_cached(old)
    new.adopt_cached(old)
    new.allocator.check()
    assert new.allocator.num_cached == 2 and new.allocator.num_free == 8
    new.add_request(1, tokens=[1, 2, 3, 4, 5])
    assert new.valid_len(1) == 4 and new.block_ids(1) == [1, 2]  # the 2 adopted blocks hold the prefix
    assert torch.equal(new.pools[0][[1, 2]], old.pools[0][[1, 2]]) and bool((new.pools[0][[1, 2]] == 1).all())


def test_prefix_caching_is_refused_where_it_cannot_be_honoured():
    gemma, _ = build("gemma3")
    with pytest.raises(ValueError, match="prefix_caching: the model's sliding-window layers"):
        KvsieveSession(gemma, None, max_tokens=64, prefix_caching=True)
    model, _ = build("llama")
    snap = kvsieve.SparseAttentionConfig("snapkv", {"prompt_budget": 16, "window_size": 4}, phases=("context",))
    with pytest.raises(ValueError, match=r"prefix_caching: selector\(s\) \['snapkv'\] evict prompt tokens"):
        KvsieveSession(model, snap, max_tokens=64, prefix_caching=True)
    with KvsieveSession(model, None, max_tokens=64, prefix_caching=True) as session:
        with pytest.raises(ValueError, match="snapkv"):
            session.set_config(snap)
        assert session.config is None
