"""``kvsieve.apply``: one line routes a model's attention through kvsieve and restores it on exit."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch
from families import build

import kvsieve
from kvsieve.integrations.transformers import ATTN_IMPLEMENTATION, apply_model


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


def test_apply_docstring_names_the_function_it_runs() -> None:
    path = re.search(r":func:`([\w.]+)`", kvsieve.apply.__doc__).group(1)
    module, name = path.rsplit(".", 1)
    assert getattr(importlib.import_module(module), name) is apply_model.apply


def test_a_prompt_longer_than_max_tokens_is_refused_by_that_name_and_changes_nothing() -> None:
    model, _ = build("llama")
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    with kvsieve.apply(model, "oracle_topk", budget=4, max_tokens=32) as session:
        session.prefill(ids[:, :24])

        def state() -> tuple:
            return (session.engine.request_ids, session.live_rows, session.num_cached_positions,
                    [c.valid_len(0) for c in session.engine.caches], [c.allocator.num_free for c in session.engine.caches],
                    model.config._attn_implementation)

        before = state()
        for run in (lambda: session.prefill(ids), lambda: model.generate(ids, max_new_tokens=2, do_sample=False)):
            with pytest.raises(ValueError, match=r"a prompt of 40 tokens per row exceeds max_tokens=32") as info:
                run()
            assert "max_num_tokens" not in str(info.value)
            assert state() == before
        tok = torch.tensor([7])
        refused_then = session.decode(tok)
        session.prefill(ids[:, :24])
        assert torch.equal(session.decode(tok), refused_then)  # the live request went on as if nothing happened
