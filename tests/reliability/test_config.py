"""Every configuration knob is type- and range-checked at construction, the error naming the knob and
what it accepts; a budget above the context means "everything" (the dense golden), not an allocation."""
from __future__ import annotations

import math

import pytest
import torch

import kvsieve
from kvsieve import KVCacheSpec, SparseRuntimeParams, lower_config
from kvsieve.sparse import SparseAttentionConfig
from kvsieve.sparse.knobs import KnobError

from .rig import make_rig

NAN = float("nan")

BAD_KNOBS = [
    ("oracle_topk", {"budget": NAN}, r"oracle_topk.budget must be an int >= 1, got float nan"),
    ("oracle_topk", {"budget": 37.5}, r"oracle_topk.budget must be an int >= 1, got float 37.5"),
    ("oracle_topk", {"budget": True}, r"oracle_topk.budget must be an int >= 1, got bool True"),
    ("oracle_topk", {"budget": 0}, r"oracle_topk.budget must be >= 1 \(an int\), got 0"),
    ("oracle_topk", {"block_size": "4"}, r"oracle_topk.block_size must be an int >= 1, got str '4'"),
    ("streaming", {"budget": 64.0}, r"streaming.budget must be an int >= 1, got float 64.0"),
    ("streaming", {"num_sink": -1}, r"streaming.num_sink must be >= 0 \(an int\), got -1"),
    ("quest", {"budget": NAN}, r"quest.budget must be an int >= 1"),
    ("quest", {"page_size": False}, r"quest.page_size must be an int >= 1, got bool False"),
    ("quest", {"summary_dtype": "int8"}, r"quest.summary_dtype must be one of \['bfloat16', 'float8_e5m2', 'float32'\]"),
    ("rocketkv", {"topr": 2.5}, r"rocketkv.topr must be an int >= 1 \(or None\), got float 2.5"),
    ("rocketkv", {"kernel_size": None}, r"rocketkv.kernel_size must be an int >= 1, got NoneType None"),
    ("rocketkv", {"prompt_budget": 10**3 + 0.5}, r"rocketkv.prompt_budget must be an int >= 1"),
    ("snapkv", {"window_size": True}, r"snapkv.window_size must be an int >= 1, got bool True"),
    ("block_select", {"score_type": 1}, r"block_select.score_type must be a string one of \['max', 'mean'\]"),
    ("block_select", {"init_blocks": -1}, r"block_select.init_blocks must be >= 0 \(an int\), got -1"),
    ("skip_softmax", {"threshold_scale_factor_generation": NAN}, r"threshold_scale_factor_generation must be a finite float >= 0"),
    ("skip_softmax", {"threshold_scale_factor_context": math.inf}, r"threshold_scale_factor_context must be a finite float"),
    ("skip_softmax", {"target_sparsity": NAN, "calibration": {"generation": (1.0, 1.0), "context": (1.0, 1.0)}},
     r"skip_softmax.target_sparsity must be a finite float in \[0, 1\)"),
    ("skip_softmax", {"target_sparsity": 0.5, "calibration": {"generation": (1.0,), "context": (1.0, 1.0)}},
     r"skip_softmax.calibration must be a dict of string -> tuple"),
    ("dsa", {"rope_theta": 0.0}, r"dsa.rope_theta must be > 0 \(a finite float or None\), got 0.0"),
    ("dsa", {"rope_theta": NAN}, r"dsa.rope_theta must be a finite float > 0 \(or None\), got float nan"),
    ("dsa", {"n_heads": True}, r"dsa.n_heads must be an int >= 1 \(or None\), got bool True"),
    ("dsa", {"index_k_dtype": "int4"}, r"dsa.index_k_dtype must be one of"),
    ("dsa", {"rope_interleave": 1}, r"dsa.rope_interleave must be a bool \(or None\), got int 1"),
]


@pytest.mark.parametrize("name, params, match", BAD_KNOBS, ids=[f"{n}-{next(iter(p))}" for n, p, _ in BAD_KNOBS])
def test_bad_knob_is_refused_naming_knob_and_range(name, params, match):
    with pytest.raises(KnobError, match=match):
        kvsieve.create_selector(name, **params)


BAD_CONFIGS = [
    ({"phases": "context"}, r"SparseAttentionConfig.phases must be a tuple of strings \(or None\), got str 'context'"),
    ({"phases": ("prefill",)}, r"phases entries must be in \['context', 'generation'\], got 'prefill'"),
    ({"phases": ()}, r"phases must be None .* or a non-empty tuple"),
    ({"dense_layers": (0.5,)}, r"SparseAttentionConfig.dense_layers must be a tuple of ints, got tuple \(0.5,\)"),
    ({"dense_layers": (True,)}, r"dense_layers must be a tuple of ints, got tuple \(True,\)"),
    ({"dense_layers": 0}, r"dense_layers must be a tuple of ints, got int 0"),
    ({"params": [("budget", 4)]}, r"SparseAttentionConfig.params must be a dict"),
]


@pytest.mark.parametrize("kwargs, match", BAD_CONFIGS, ids=[f"{next(iter(k))}-{i}" for i, (k, _) in enumerate(BAD_CONFIGS)])
def test_bad_sparse_attention_config_is_refused(kwargs, match):
    with pytest.raises(KnobError, match=match):
        SparseAttentionConfig("streaming", **kwargs)


def test_selector_name_must_be_a_string():
    with pytest.raises(KnobError, match=r"SparseAttentionConfig.selector must be a string, got NoneType"):
        SparseAttentionConfig(None)


def test_list_knobs_are_taken_as_tuples():
    cfg = SparseAttentionConfig("streaming", {"budget": 8}, dense_layers=[0], phases=["generation"])
    assert cfg.dense_layers == (0,) and cfg.phases == ("generation",)
    plans = lower_config(cfg, num_layers=2)
    assert plans[0] is None and plans[1].phases == frozenset({"generation"})


@pytest.mark.parametrize("kwargs, err, match", [
    ({"num_layers": 0}, KnobError, r"lower_config.num_layers must be >= 1 \(an int\), got 0"),
    ({"num_layers": True}, KnobError, r"lower_config.num_layers must be an int >= 1, got bool True"),
    ({"num_layers": 2, "attention_kind": "mha"}, KnobError, r"attention_kind must be one of \['gqa', 'mla'\]"),
])
def test_lower_config_arguments_are_checked(kwargs, err, match):
    with pytest.raises(err, match=match):
        lower_config(SparseAttentionConfig("streaming"), **kwargs)


def test_unknown_selector_field_is_refused_listing_the_accepted_ones():
    with pytest.raises(ValueError, match=r"selector 'streaming': bad config \['bugdet'\].*accepted fields: \['budget', 'num_sink'\]"):
        lower_config(SparseAttentionConfig("streaming", {"bugdet": 8}), num_layers=1)


@pytest.mark.parametrize("field, value", [("threshold_scale_factor_context", NAN), ("threshold_scale_factor_context", -1.0),
                                          ("threshold_scale_factor_generation", math.inf),
                                          ("threshold_scale_factor_context", True)])
def test_params_validate_refuses_non_finite_thresholds(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a finite float >= 0"):
        SparseRuntimeParams(**{field: value}).validate(num_kv_heads=1)


def test_params_validate_refuses_a_bool_block_size():
    with pytest.raises(ValueError, match="sparse_attn_indices_block_size must be >= 1"):
        SparseRuntimeParams(sparse_attn_indices_block_size=True).validate(num_kv_heads=1)


@pytest.mark.parametrize("field, value", [("num_blocks", 8.0), ("tokens_per_block", True), ("max_requests", "4")])
def test_kv_cache_spec_counts_must_be_ints(field, value):
    base = dict(num_layers=1, num_blocks=8, tokens_per_block=4)
    with pytest.raises(TypeError, match=f"KVCacheSpec.{field} must be an int >= 1"):
        KVCacheSpec(**{**base, field: value})


@pytest.mark.parametrize("name, params", [
    ("oracle_topk", {"budget": 10**18}), ("oracle_topk", {"budget": 10**18, "block_size": 4}),
    ("streaming", {"budget": 10**18}), ("streaming", {"budget": 10**18, "num_sink": 10**17}),
    ("quest", {"budget": 10**18, "page_size": 4, "summary_dtype": "float32"}),
    ("block_select", {"block_size": 4, "topk_blocks": 10**18}),
    ("dsa", {"index_topk": 10**18, "n_heads": 2, "head_dim": 8, "rope_dim": 4, "index_k_dtype": "float32",
             "topk_engine": "torch"}),
])
def test_budget_above_the_context_means_everything(name, params):
    """Result equal to the dense golden (every position attended), no budget-sized allocation."""
    steps = [([1, 2], [13, 6], 2), ([1, 2], [1, 2], 0)]
    sparse, dense = make_rig(name, params, num_layers=1), make_rig(None, num_layers=1)
    for i, (r, n, c) in enumerate(steps):
        inputs = sparse.inputs(sum(n), seed=i)
        extra = None
        if name == "dsa":
            gen = torch.Generator().manual_seed(i)
            extra = kvsieve.selectors.dsa.projections.IndexerInputs(
                q_index=torch.randn(sum(n), 2, 8, generator=gen), k_index=torch.randn(sum(n), 8, generator=gen),
                weights=torch.rand(sum(n), 2, generator=gen))
        got = sparse.engine.step(r, n, c, inputs, [extra])
        want = dense.engine.step(r, n, c, inputs)
        torch.testing.assert_close(got[0].out, want[0].out, rtol=1e-5, atol=1e-5)
        stats = got[0].stats
        assert stats.attended == stats.dense


@pytest.mark.parametrize("field, value, match", [
    ("max_num_requests", 0, r"Engine.max_num_requests must be >= 1 \(an int\), got 0"),
    ("max_num_tokens", 12.0, r"Engine.max_num_tokens must be an int >= 1, got float 12.0"),
    ("max_num_tokens", True, r"Engine.max_num_tokens must be an int >= 1, got bool True"),
])
def test_engine_capacities_are_checked(field, value, match):
    from kvsieve import Engine, KVCacheManager

    cache = KVCacheManager(KVCacheSpec(num_layers=1, num_blocks=8, tokens_per_block=4))
    kwargs = {"max_num_requests": 2, "max_num_tokens": 16, field: value}
    with pytest.raises(KnobError, match=match):
        Engine(cache, [], **kwargs)
