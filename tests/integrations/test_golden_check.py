"""``check_steps``: random generation steps recomputed with the Vanilla golden during a run."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from families import build

from kvsieve import SparseAttentionConfig
from kvsieve.integrations.transformers import KvsieveSession


def _decode(session: KvsieveSession, steps: int) -> None:
    logits = session.prefill(torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(0)))
    session.continue_greedy(logits, steps)


def test_checks_the_requested_number_of_steps() -> None:
    model, _ = build("gpt_oss")  # windows + sinks, torch backend, a selector on the full layers
    session = KvsieveSession(model, SparseAttentionConfig("quest", {"budget": 16}), max_tokens=64, check_steps=2)
    _decode(session, 20)
    assert session.golden_check.steps_checked == 2
    assert 0 < session.golden_check.max_diff < 1e-5


def test_a_backend_that_drops_the_window_is_caught() -> None:
    model, _ = build("mistral")
    session = KvsieveSession(model, None, max_tokens=64, check_steps=3)
    session.backend.features = [dataclasses.replace(f, window=None) for f in session.features]
    with pytest.raises(AssertionError, match="differs from vanilla"):
        _decode(session, 30)
