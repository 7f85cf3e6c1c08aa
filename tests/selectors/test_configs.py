"""Defaults are the published ones; bad values raise at construction, naming field and range."""
from __future__ import annotations

import pytest

import kvsieve
from kvsieve.selectors import BlockSelectConfig, QuestConfig, RocketKVConfig, SnapKVConfig


def test_published_defaults():
    r = RocketKVConfig()
    assert (r.window_size, r.kernel_size, r.prompt_budget, r.page_size, r.topk, r.topr) == (32, 63, 2048, 4, 64, None)
    assert r.summary_dtype == "float8_e5m2"
    q = QuestConfig()
    assert (q.page_size, q.budget, q.topk) == (16, 256, 16)
    s = SnapKVConfig()
    assert (s.window_size, s.kernel_size) == (32, 7)
    b = BlockSelectConfig()
    assert (b.block_size, b.topk_blocks, b.init_blocks, b.local_blocks, b.score_type) == (128, 16, 0, 1, "max")


@pytest.mark.parametrize("name, params, match", [
    ("rocketkv", {"window_size": 64, "prompt_budget": 32}, r"rocketkv.window_size must be <= prompt_budget=32"),
    ("rocketkv", {"kernel_size": 4}, "rocketkv.kernel_size must be odd"),
    ("rocketkv", {"page_size": 3}, "rocketkv.page_size must be a power of two"),
    ("rocketkv", {"topk": 0}, "topk .* must be >= 1"),
    ("rocketkv", {"topr": 0}, "topr must be >= 1"),
    ("rocketkv", {"summary_dtype": "int8"}, "summary_dtype must be one of"),
    ("snapkv", {"window_size": 2048, "prompt_budget": 1024}, r"snapkv.window_size must be <= prompt_budget=1024"),
    ("snapkv", {"prompt_budget": 0}, "prompt_budget must be >= 1"),
    ("quest", {"page_size": 12}, "quest.page_size must be a power of two"),
    ("quest", {"budget": 8}, "quest.budget must be >= page_size=16"),
    ("block_select", {"topk_blocks": 0}, "topk_blocks must be >= 1"),
    ("block_select", {"score_type": "sum"}, r"score_type must be one of \['max', 'mean'\]"),
    ("block_select", {"init_blocks": 2, "local_blocks": 2, "topk_blocks": 3},
     r"block_select.init_blocks \+ local_blocks must be <="),
    ("block_select", {"block_size": 0}, "block_size must be >= 1"),
])
def test_bad_values_raise_at_construction(name, params, match):
    with pytest.raises(ValueError, match=match):
        kvsieve.create_selector(name, **params)


def test_registered_and_capabilities():
    assert {"rocketkv", "quest", "snapkv", "block_select"} <= set(kvsieve.available_selectors())
    for name in ("rocketkv", "quest", "block_select", "snapkv"):
        with pytest.raises(ValueError, match="does not support attention kind 'mla'"):
            kvsieve.lower_config(kvsieve.SparseAttentionConfig(name), num_layers=1, attention_kind="mla")
    with pytest.raises(ValueError, match="evicts prompt tokens"):
        kvsieve.lower_config(kvsieve.SparseAttentionConfig("rocketkv", dense_layers=(0,)), num_layers=2)
    assert kvsieve.create_selector("rocketkv", page_size=8).page_knobs(64).page_size == 8
