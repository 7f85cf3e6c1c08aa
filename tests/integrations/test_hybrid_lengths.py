"""Per-layer lengths on a hybrid model (Gemma 3: sliding-window and full-attention layers): each
kind has its own cache group; the windowed group drops blocks wholly out of its window; prompt
eviction (SnapKV, RocketKV) runs on the full-attention layers alone."""
from __future__ import annotations

import pytest
import torch
from families import WINDOW, build

import kvsieve
from kvsieve import SparseAttentionConfig
from kvsieve.integrations.transformers import KvsieveSession


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def test_window_release_bounds_the_windowed_group_and_changes_no_token() -> None:
    model, ref = build("gemma3")  # layers 0, 2 slide (window 8), layers 1, 3 full
    ids = _ids(70)
    want = ref.generate(ids, max_new_tokens=12, do_sample=False)
    with KvsieveSession(model, None, max_tokens=128, tokens_per_block=4) as session:
        full, windowed = session.engine.caches
        assert full.spec.layers == (1, 3) and windowed.spec.layers == (0, 2)
        got = session.generate(ids, max_new_tokens=12)
        assert torch.equal(got, want[:, 70:])
        n = session.num_cached_positions
        assert full.allocator.num_held == -(-n // 4)
        # the next query reads [n + 1 - 8, n]: only the blocks holding those positions are kept
        assert windowed.allocator.num_held == -(-n // 4) - (n + 1 - WINDOW) // 4 <= WINDOW // 4 + 1
        assert windowed.valid_len(0) == full.valid_len(0) == n  # positions are not renumbered
        windowed.allocator.check()
        with pytest.raises(ValueError, match="dropped positions"):
            session.rewind(40)
        assert session.num_cached_positions == n
    with KvsieveSession(model, None, max_tokens=128, tokens_per_block=4, release_windows=False) as kept:
        assert torch.equal(kept.generate(ids, max_new_tokens=12), got)
        assert kept.engine.caches[1].allocator.num_held == -(-kept.num_cached_positions // 4)
        kept.rewind(40)


@pytest.mark.parametrize("selector,params", [
    ("snapkv", {"window_size": 4, "kernel_size": 3, "prompt_budget": 24}),
    ("rocketkv", {"window_size": 4, "kernel_size": 3, "prompt_budget": 24, "page_size": 4, "topk": 3,
                  "summary_dtype": "float32"}),
])
def test_prompt_eviction_runs_on_the_full_attention_layers_of_gemma3(selector, params) -> None:
    model, ref = build("gemma3")
    ids = _ids(60, seed=1)
    with kvsieve.apply(model, selector, **params) as session:
        plans = [layer.plan is not None for layer in session.layers]
        assert plans == [False, True, False, True]  # the windowed layers stay dense
        out = model.generate(ids, max_new_tokens=5, do_sample=False)
        full, windowed = session.engine.caches
        assert full.valid_len(0) == 24 + 4  # the kept prompt plus the decoded tokens but the last
        assert windowed.valid_len(0) == 60 + 4
    assert out.shape == (1, 65)
    # a budget covering the prompt (and, for RocketKV, a top-k covering every page) keeps
    # everything: exactly plain transformers
    roomy = {**params, "prompt_budget": 64, **({"topk": 32} if selector == "rocketkv" else {})}
    with kvsieve.apply(model, selector, **roomy):
        assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False),
                           ref.generate(ids, max_new_tokens=5, do_sample=False))


def test_an_evicting_selector_on_some_full_layers_only_is_refused() -> None:
    model, _ = build("llama")
    with pytest.raises(ValueError, match="evicts prompt tokens"):
        KvsieveSession(model, SparseAttentionConfig("snapkv", {"window_size": 4, "kernel_size": 3, "prompt_budget": 8},
                                                    dense_layers=(0,)), max_tokens=64)
