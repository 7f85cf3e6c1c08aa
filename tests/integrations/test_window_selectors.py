"""A selector on a sliding-window layer sees only the window.

Tiny random Mistral (every layer windowed) and Gemma 3 (local/global interleaved, the selector run
on both types) with a window of 32 and a context of 80-83 tokens: every built-in selector that
declares ``Capabilities.sliding_window`` chooses only units that overlap each query's window
``[kv_len - 32, kv_len)`` and keeps as many as its budget allows there (``min(budget, window)``
in its own unit), where scoring the whole context spent part of the budget on positions the window
then drops. A selector without the flag is refused naming the selector and the layer type."""
from __future__ import annotations

import pytest
import torch
from default_selectors import DEFAULT_SELECTORS
from families import build

from kvsieve import SparseAttention, SparseAttentionConfig, SparseSelector, lower_config
from kvsieve.integrations.transformers import attach_dsa_indexer
from kvsieve.integrations.transformers import KvsieveSession
from kvsieve.selectors.dsa.projections import IndexerProjections
from kvsieve.sparse import Capabilities, LayerPlan
from kvsieve.sparse.registry import get_selector_class

W, PROMPT, DECODE = 32, 80, 3
BOTH = ("full_attention", "sliding_attention")
#: the window-sized part of each selector's default configuration (tests/default_selectors.py): a
#: budget below the window of 32, in units that tile it (pages / blocks of 4)
WINDOW_SIZED = {
    "streaming": {"budget": 16},
    "oracle_topk": {"budget": 16, "block_size": 1},
    "quest": {"budget": 16, "page_size": 4},
    "block_select": {"block_size": 4, "topk_blocks": 4, "local_blocks": 1},
    "dsa": {"index_topk": 16},
}


def _unit_and_budget(params: dict) -> tuple[int, int]:
    """A configuration's selection unit in tokens and its budget in units."""
    if "topk_blocks" in params:
        return params["block_size"], params["topk_blocks"]
    if "index_topk" in params:
        return 1, params["index_topk"]
    unit = params.get("page_size", params.get("block_size", 1))
    return unit, params["budget"] // unit


#: every built-in that declares the flag -> (params, unit in tokens, budget in units)
SELECTORS = {name: (params, *_unit_and_budget(params)) for name, params in (
    (name, {**DEFAULT_SELECTORS[name], **WINDOW_SIZED.get(name, {})}) for name in DEFAULT_SELECTORS
    if get_selector_class(name).capabilities.sliding_window)}


def test_every_window_selector_is_covered() -> None:
    """The list above is the registry's: a built-in that declares the flag without a window-sized
    entry fails here, not silently skipped."""
    assert set(SELECTORS) == set(WINDOW_SIZED)


def _run(family: str, name: str, *, told: bool = True) -> tuple[KvsieveSession, list[tuple]]:
    """Prefill + decode with ``name`` on every layer; per (layer, step): the layer's window, the
    step's token lengths, the selector's placed params and the rows of the phases it selected in.
    ``told=False`` hides the window from the selectors (the old behaviour) while the backend still
    applies it."""
    model, _ = build(family, window=W)
    params = SELECTORS[name][0]
    types = BOTH if family == "gemma3" else None  # Mistral: every layer is windowed, all run it by default
    # not told: the windowed layers keep every block, as before the window release (a released block
    # reads as zeros, which an untold selector would score too)
    session = KvsieveSession(model, SparseAttentionConfig(name, params, layer_types=types), max_tokens=128,
                             release_windows=told)
    if name == "dsa":
        torch.manual_seed(0)
        session.layers[0].plan.selector.set_projections({i: IndexerProjections(64, 2, 16, 8) for i in range(4)})
        attach_dsa_indexer(session)
    if not told:
        for layer in session.layers:
            layer.window = None
    seen = []

    def record(layer_idx, q, result, md, layer):
        p = result.params
        rows = [t for ph in md.phases() if p is not None and p.selects_positions(ph) for t in range(
            md.phase_rows(ph).start, md.phase_rows(ph).stop)]
        seen.append((session.features[layer_idx].window, md.token_kv_lens.clone(), p, rows))

    session.observers.append(record)
    session.generate(torch.randint(3, 96, (1, PROMPT), generator=torch.Generator().manual_seed(0)), DECODE + 1)
    return session, seen


def _units(p, t: int) -> torch.Tensor:
    """Selected units of row ``t`` (all KV heads), ``[Hkv, k]`` with ``-1`` = none."""
    off = p.sparse_attn_offsets
    return p.sparse_attn_indices[:, int(off[t]): int(off[t + 1])].to(torch.int64)


def _in_window_counts(seen: list[tuple], unit: int) -> tuple[list[int], list[int], list[int]]:
    """Per (windowed layer, selected row, KV head): units chosen, of those overlapping the window,
    and the units the window holds (overlapping ``[kv_len - W, kv_len)``)."""
    chosen, inside, avail = [], [], []
    for window, lens, p, rows in seen:
        if window is None:
            continue
        for t in rows:
            n = int(lens[t])
            lo = max(0, n - window)
            u = _units(p, t)
            valid = u >= 0
            hit = valid & ((u + 1) * unit > lo) & (u * unit < n)
            chosen += valid.sum(-1).tolist()
            inside += hit.sum(-1).tolist()
            avail += [(n - 1) // unit - lo // unit + 1] * u.shape[0]
    return chosen, inside, avail


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
@pytest.mark.parametrize("name", list(SELECTORS))
def test_selection_lies_in_the_window_and_spends_the_budget_there(family: str, name: str) -> None:
    _, seen = _run(family, name)
    budget = SELECTORS[name][2]
    chosen, inside, avail = _in_window_counts(seen, SELECTORS[name][1])
    assert chosen, "no selected row on a windowed layer"
    assert inside == chosen  # nothing outside the window
    assert inside == [min(budget, a) for a in avail]  # the whole budget, or the whole window when smaller
    # the decode rows see 80+ tokens against a window of 32: the window, not the context, bounds them
    assert max(avail) <= -(-W // SELECTORS[name][1]) + 1


@pytest.mark.parametrize("name", list(SELECTORS))
def test_scoring_the_whole_context_wasted_budget(name: str) -> None:
    """Control: the same selector not told the window picks units the window drops (streaming's
    sinks at positions 0..3 always; the scoring selectors whatever scores high before the window)."""
    _, seen = _run("mistral", name, told=False)
    chosen, inside, avail = _in_window_counts(seen, SELECTORS[name][1])
    budget = SELECTORS[name][2]
    assert sum(inside) < sum(min(budget, a) for a in avail)
    print(f"{name} not told the window: {sum(inside)} of {sum(chosen)} chosen units inside it")  # shown with -s


def test_selector_without_the_flag_is_refused_naming_it_and_the_layer_type() -> None:
    model, _ = build("gemma3", window=W)
    with pytest.raises(ValueError, match=r"layer 0 \(sliding_attention layer\): selector 'skip_softmax' does not "
                                         r"declare Capabilities\(sliding_window=True\).*window 32"):
        KvsieveSession(model, SparseAttentionConfig("skip_softmax", {"threshold_scale_factor_generation": 1.0},
                                                    layer_types=BOTH), max_tokens=128)
    # the default plan of an interleaved model (full-attention layers only) is not refused
    session = KvsieveSession(model, SparseAttentionConfig("skip_softmax", {"threshold_scale_factor_generation": 1.0}),
                             max_tokens=128)
    assert [layer.plan is not None for layer in session.layers] == [f.window is None for f in session.features]


def test_third_party_selector_defaults_to_no_window_support() -> None:
    class FirstToken(SparseSelector):
        name = "first_token"
        config_class = dict
        capabilities = Capabilities()

        def predict_attn(self, inputs):
            return None

    plan = LayerPlan(FirstToken({}), frozenset({"generation"}))
    SparseAttention(layer_idx=3, num_q_heads=4, num_kv_heads=2, head_dim=16, plan=plan)  # no window: fine
    with pytest.raises(ValueError, match=r"layer 3: selector 'first_token' does not declare "
                                         r"Capabilities\(sliding_window=True\)"):
        SparseAttention(layer_idx=3, num_q_heads=4, num_kv_heads=2, head_dim=16, plan=plan, window=8)
    layer = SparseAttention(layer_idx=3, num_q_heads=4, num_kv_heads=2, head_dim=16, window=8)
    with pytest.raises(ValueError, match="first_token"):
        layer.plan = plan
    assert layer.plan is None  # the refused plan was not installed


def test_window_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match=r"SparseAttention.window must be >= 1 \(an int\), got 0"):
        SparseAttention(layer_idx=0, num_q_heads=4, num_kv_heads=2, head_dim=16, window=0)
    with pytest.raises(ValueError, match="layer_windows has 1 entries for 2 layers"):
        lower_config(SparseAttentionConfig("streaming"), num_layers=2, layer_windows=[8])
    plans = lower_config(SparseAttentionConfig("streaming"), num_layers=2, layer_windows=[None, 8])
    assert plans[0] is plans[1]  # a window-aware selector is planned on both


def test_dsa_window_within_its_budget_is_dense_in_the_window() -> None:
    """DSA with ``index_topk`` >= the window selects all of a windowed layer's window: it answers
    ``None`` there (dense; the backend applies the window) and the logits equal a session whose
    windowed layers run no selector at all (the full-attention layers select in both)."""
    def run(types):
        model, _ = build("gemma3", window=W)
        session = KvsieveSession(model, SparseAttentionConfig("dsa", {"index_topk": 48, "n_heads": 2, "head_dim": 16,
                                                                      "rope_dim": 8}, layer_types=types), max_tokens=128)
        torch.manual_seed(0)
        sel = next(layer.plan.selector for layer in session.layers if layer.plan is not None)
        sel.set_projections({i: IndexerProjections(64, 2, 16, 8) for i in range(4)})
        attach_dsa_indexer(session)
        placed = []
        session.observers.append(lambda i, q, result, md, layer: placed.append(
            (session.features[i].window, layer.plan is not None, result.params)))
        ids = torch.randint(3, 96, (1, PROMPT), generator=torch.Generator().manual_seed(0))
        logits = [session.prefill(ids)]
        for _ in range(DECODE):
            logits.append(session.decode(logits[-1].argmax(-1)))
        return torch.stack(logits), placed, sel

    both, placed, sel = run(BOTH)
    full_only, _, _ = run(("full_attention",))
    windowed = [p for w, planned, p in placed if w is not None]
    assert windowed and all(p is None for p in windowed)
    assert any(p is not None for w, _, p in placed if w is None), "the full-attention layers still select"
    assert sel.stats.short_path_steps >= len(windowed)
    assert torch.equal(both, full_only)
