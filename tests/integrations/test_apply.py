"""``kvsieve.apply``: one line routes a model's attention through kvsieve and restores it on exit."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from families import build

import kvsieve
from kvsieve.integrations.transformers import ATTN_IMPLEMENTATION


def test_apply_routes_then_restores() -> None:
    model, ref = build("gemma3")
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    with kvsieve.apply(model, "oracle_topk", budget=4) as session:
        assert model.config._attn_implementation == ATTN_IMPLEMENTATION
        sparse = model.generate(ids, max_new_tokens=4, do_sample=False)
    frac = session.attended_fraction("generation")
    window = sum(8 / n for n in (41, 42, 43)) / 3  # sliding layers (0, 2): their window of 8, no selector
    budget = sum(4 / n for n in (41, 42, 43)) / 3  # full layers (1, 3): the selector's 4 positions
    assert frac == pytest.approx([window, budget, window, budget], rel=0.02)
    assert model.config._attn_implementation == "eager"
    assert not any(hasattr(layer.self_attn, "kvsieve_session") for layer in model.model.layers)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    assert sparse.shape == (1, 44)


def test_apply_dense_refuses_selector_settings() -> None:
    model, _ = build("llama")
    with pytest.raises(ValueError, match="budget"):
        kvsieve.apply(model, None, budget=4)
    assert model.config._attn_implementation == "eager"


def test_readme_example_runs_as_written() -> None:
    text = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    section = text.split("## Using it", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "kvsieve.apply(" in code
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102
    assert scope["out"].shape[1] == scope["ids"].shape[1] + 8
    assert scope["lm"].model.config._attn_implementation != ATTN_IMPLEMENTATION
