"""The presets lower to the per-selector configs they gave before the budget vocabulary
(selectors declaring their knob, :func:`kvsieve.sparse.lower_budget` converting), and budgets a
selector cannot honour are refused by name.

``OLD_ENTRIES`` is what each preset entry wrote by hand before (``budget_params``,
``budget_multiple``, ``sparsity_params``); :func:`old_lowering` is the harness's rule of that
time, so the expected values here do not come from the new conversion."""
from __future__ import annotations

import math

import pytest

from kvsieve.eval import config as cfgmod
from kvsieve.eval.config import SelectorSpec, from_dict, load_config
from kvsieve.sparse import BudgetKnob, available_selectors, get_selector_class, lower_budget
from kvsieve.sparse.knobs import KnobError

#: preset -> label -> (budget_params, budget_multiple, sparsity_params) as the YAML had them
OLD_ENTRIES = {
    cfgmod.QUICK: {
        "oracle_topk": (["budget"], 1, []), "streaming": (["budget"], 1, []), "quest": (["budget"], 1, []),
        "block_select": ({"topk_blocks": 16}, 1, []), "snapkv": (["prompt_budget"], 1, []),
    },
    cfgmod.DEFAULT: {"oracle_topk": (["budget"], 1, []), "oracle_block16": (["budget"], 16, []),
                     "streaming": (["budget"], 1, [])},
    cfgmod.RECIPES: {
        "oracle_topk": (["budget"], 1, []), "oracle_page": (["budget"], 16, []), "streaming": (["budget"], 1, []),
        "quest": (["budget"], 16, []), "rocketkv": ({"topk": 4}, 4, []), "dsa": (["index_topk"], 1, []),
        "block_select": ({"topk_blocks": 128}, 128, []), "block_select16": ({"topk_blocks": 16}, 16, []),
        "snapkv": (["prompt_budget"], 1, []), "snapkv_kvpress": (["prompt_budget"], 1, []),
        "skip_softmax": ([], 1, ["target_sparsity"]),
    },
}


def old_lowering(spec: SelectorSpec, length: int, entry: tuple) -> list[tuple[int, float, float, dict]]:
    """The harness's rule before: tokens by form, rounded down to ``budget_multiple`` (at least
    one multiple), then ``tokens // unit`` into each budget param and the sparsity into each
    sparsity param."""
    budget_params, m, sparsity_params = entry
    out = []
    for form in ("budgets", "sparsities", "reduction_factors"):
        for x in getattr(spec, form):
            tokens = {"budgets": lambda: int(x), "sparsities": lambda: math.ceil(length * (1 - x)),
                      "reduction_factors": lambda: math.ceil(length / x)}[form]()
            tokens = max(m, tokens // m * m)
            sparsity = max(0.0, 1 - tokens / length)
            units = budget_params if isinstance(budget_params, dict) else dict.fromkeys(budget_params, 1)
            params = dict(spec.params) | {p: tokens // u for p, u in units.items()} | dict.fromkeys(sparsity_params,
                                                                                                     sparsity)
            out.append((tokens, sparsity, length / tokens, params))
    return out


@pytest.mark.parametrize("preset", list(OLD_ENTRIES))
def test_presets_lower_to_the_configs_they_gave_before(preset):
    cfg = load_config(preset=preset)
    lengths = sorted({n for t in cfg.tasks for n in t.lengths} | {1024, 2048, 4096, 8192, 16384})
    assert {s.label for s in cfg.selectors} == set(OLD_ENTRIES[preset])
    checked = 0
    for spec in cfg.selectors:
        for length in lengths:
            if preset == cfgmod.RECIPES and length < 2048 and spec.label == "block_select":
                continue  # a block of 128 is more than 1/16 of a shorter context: refused (below)
            new = [(b.tokens, b.sparsity, b.reduction_factor, spec.sparse_config(b).params) for b in spec.resolve(length)]
            assert new == old_lowering(spec, length, OLD_ENTRIES[preset][spec.label]), (spec.label, length)
            checked += len(new)
    assert checked > 0


def test_every_selector_declares_its_budget_knob_on_its_class():
    for name in available_selectors():
        cls = get_selector_class(name)
        if cls.__module__.startswith("kvsieve."):
            assert "budget" in vars(cls), f"{name} does not declare its budget knob"
            assert isinstance(cls.budget, BudgetKnob)


def test_rounding_and_refusals():
    quest, block, rocket = (get_selector_class(n) for n in ("quest", "block_select", "rocketkv"))
    # a density: the most whole units within ceil(L * density) tokens
    low = lower_budget(block, {"block_size": 16}, 1000, sparsity=0.9)  # ceil(100.0...) = 100 -> 6 blocks
    assert (low.tokens, low.knob) == (96, {"topk_blocks": 6}) and low.sparsity == pytest.approx(0.904)
    assert lower_budget(quest, {}, 1000, reduction_factor=8).knob == {"budget": 112}  # 125 -> 7 pages of 16 (default)
    assert lower_budget(rocket, {}, 4096, sparsity=0.984375).knob == {"topk": 16}  # 64 tokens, pages of 4 (default)
    skip = get_selector_class("skip_softmax")
    assert lower_budget(skip, {}, 2048, sparsity=0.9375).knob == {"target_sparsity": 0.9375}
    with pytest.raises(KnobError, match=r"block_select\.topk_blocks: sparsity 0.984375 at 4096 tokens asks 64 "
                                        r"tokens, less than one unit of 128"):
        lower_budget(block, {"block_size": 128}, 4096, sparsity=0.984375)
    with pytest.raises(KnobError, match=r"quest\.budget: a budget of 100 tokens is not a whole number .* of 16"):
        lower_budget(quest, {"page_size": 16}, 1024, tokens=100)
    with pytest.raises(ValueError, match="exactly one"):
        lower_budget(quest, {}, 1024, tokens=64, sparsity=0.5)
    with pytest.raises(ValueError, match="unit must be one of"):
        BudgetKnob("budget", unit="bytes")
    with pytest.raises(ValueError, match="needs unit_size_field"):
        BudgetKnob("topk", unit="pages")


def test_the_sweep_config_refuses_what_cannot_be_honoured_and_the_old_keys(tmp_path):
    raw = {"output_dir": str(tmp_path), "tasks": {"passkey": {"lengths": [1024]}},
           "selectors": {"block_select": {"sparsities": [0.984375], "params": {"block_size": 128}}}}
    with pytest.raises(ValueError, match=r"selectors\.block_select: block_select\.topk_blocks: sparsity 0\.984375 "
                                         r"at 1024 tokens asks 16 tokens, less than one unit of 128"):
        from_dict(raw)
    raw["selectors"] = {"quest": {"budgets": [64], "budget_multiple": 16}}
    with pytest.raises(ValueError, match=r"selectors\.quest\.budget_multiple: refused: each selector declares"):
        from_dict(raw)
