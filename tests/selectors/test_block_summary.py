"""``block_select`` with ``scoring="summary"`` (min/max key summaries per block) against the exact
mode: recall of the exact top-k blocks on a fixed structured input, attention-mass recall, the
needle, valid selections, and the exact mode keeping no summary pool. (Fast path vs its
per-request reference: ``test_naive_vs_fast.py``.)"""
from __future__ import annotations

import pytest

from harness import Harness, selection_sets
from recall_table import make_input, run_selector, selector_params

BLOCK, TOPK = 32, 4
#: share of the exact mode's top-k blocks the summary mode also picks, over the prefill rows that see
#: more than TOPK blocks (so the choice is not forced). Measured 0.70 on this input (chance: 0.28).
MIN_BLOCK_RECALL = 0.65


@pytest.fixture(scope="module")
def data():
    return make_input(prompt_len=1024, decode_steps=3, seed=1)


def _prefill(scoring: str, data):
    h = Harness("block_select", {"block_size": BLOCK, "topk_blocks": TOPK, "scoring": scoring}, hkv=2, g=4, d=64)
    inputs = h.hook_inputs([0], [data.prompt_len], 1, data.q, data.k, data.v)
    return h, inputs, h.selector.predict_attn(inputs)


def test_summary_recalls_the_exact_top_blocks(data):
    _, inputs, exact = _prefill("exact", data)
    h, inputs, summary = _prefill("summary", data)
    summary.validate(num_kv_heads=2, num_query_tokens=data.prompt_len, kv_lens=inputs.metadata.token_kv_lens)
    a, b = selection_sets(exact, data.prompt_len, 2), selection_sets(summary, data.prompt_len, 2)
    hit = total = 0
    for t in range(BLOCK * TOPK, data.prompt_len):  # rows with more than TOPK visible blocks
        for sa, sb in zip(a[t], b[t]):
            assert len(sb) == TOPK and max(sb) == t // BLOCK  # full budget, own (local) block forced in
            hit, total = hit + len(sa & sb), total + len(sa)
    recall = hit / total
    print(f"block_select summary vs exact top-{TOPK} blocks of {BLOCK}: recall {recall:.3f}")
    assert recall >= MIN_BLOCK_RECALL
    assert list(h.cache.aux_pools) == ["page_summary_p16_float32"]  # gcd(32, tokens_per_block 16)


def test_summary_keeps_attention_mass_and_the_needle(data):
    params = selector_params(128)["block_select"]
    exact = run_selector("block_select", params, data)
    summary = run_selector("block_select", {**params, "scoring": "summary"}, data)
    print(f"attention-mass recall: exact {exact.recall:.3f}, summary {summary.recall:.3f}")
    assert all(data.needle in head for step in summary.selected for head in step)
    assert summary.attended_fraction == pytest.approx(exact.attended_fraction)
    assert summary.recall >= 0.95 * exact.recall  # measured 0.625 vs 0.624


def test_exact_mode_keeps_no_summary_pool(data):
    h, _, _ = _prefill("exact", data)
    assert h.selector.config.scoring == "exact"  # the default
    assert h.cache.aux_pools == {}


@pytest.mark.parametrize("params, match", [
    ({"scoring": "summary", "score_type": "mean"}, "block_select.scoring must be 'exact' for score_type='mean'"),
    ({"scoring": "minmax"}, r"scoring \(where block scores come from\) must be one of \['exact', 'summary'\]"),
])
def test_summary_config_errors(params, match):
    from kvsieve.selectors.block_select.selector import BlockSelectConfig
    with pytest.raises(ValueError, match=match):  # KnobError is a ValueError
        BlockSelectConfig(**params)

