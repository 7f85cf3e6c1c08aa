"""``kvsieve eval``'s ``acceptance`` task: mean accepted length of lossless decoding per selector,
budget and length, on a tiny random Llama (the sweep's files), and the rounds against a
speculative session's own."""
from __future__ import annotations

import json

import pytest
import torch

from kvsieve import SparseAttentionConfig
from kvsieve.eval.acceptance import AcceptanceTask, _capped
from kvsieve.eval.config import from_dict
from kvsieve.eval.model import load_model
from kvsieve.eval.runner import run_sweep
from kvsieve.integrations.transformers import KvsieveSession
from kvsieve.sparse.speculation import AcceptanceStats


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


def test_acceptance_sweep_reports_accepted_lengths_per_selector_budget_and_length(tmp_path, tiny) -> None:
    cfg = from_dict({"model": "tiny-random", "output_dir": str(tmp_path), "seed": 0,
                     "tasks": {"acceptance": {"lengths": [160], "samples": 1}},
                     "selectors": {"quest": {"budgets": [16], "params": {"page_size": 16}},
                                   "snapkv": {"budgets": [64], "phases": ["context"]}}})
    run_sweep(cfg, loaded=tiny, progress=False, log=lambda _: None)
    dense = json.loads((tmp_path / "acceptance__160__tiny-random-llama__dense__full" / "metrics.json").read_text())
    quest = json.loads((tmp_path / "acceptance__160__tiny-random-llama__quest__b16" / "metrics.json").read_text())
    # dense drafts are the verify pass's tokens (up to rounding ties): every draft accepted
    assert dense["accepted_length_k8"] == pytest.approx(9.0, abs=0.5) and dense["score"] == dense["accepted_length_k4"]
    for m in (dense, quest):
        assert 1 <= m["accepted_length_k2"] <= m["accepted_length_k4"] <= m["accepted_length_k8"] <= 9
        assert m["accepted_length_k2"] <= 3 and m["accepted_length_k4"] <= 5
    assert quest["accepted_length_k8"] < dense["accepted_length_k8"]  # a 16-token budget drafts worse
    error = (tmp_path / "acceptance__160__tiny-random-llama__snapkv__b64" / "error.txt").read_text()
    assert "acceptance: speculate: selector(s) ['snapkv'] evict prompt tokens" in error


def test_draft_lengths_choose_the_rows_lengths_and_the_longest_drafts(tiny) -> None:
    ids = torch.tensor([tiny.tokenizer.encode("The printing press changed how ideas travelled. " * 5)])
    cfg = SparseAttentionConfig("quest", {"budget": 16, "page_size": 16})
    with KvsieveSession(tiny.model, cfg) as session:
        row = AcceptanceTask(draft_lengths=[4]).run(session, session.prefill(ids), ids, None, None, tiny.tokenizer)
    assert sorted(row) == ["acceptance_by_position_k4", "accepted_length_k4", "score"]
    assert len(row["acceptance_by_position_k4"].split("|")) == 4 and row["score"] == row["accepted_length_k4"]


@pytest.mark.parametrize("lengths", [[2, 8], [3, 4], [4, 4], "4", [True, 4], [], [[4], 4]])
def test_draft_lengths_the_summary_cannot_hold_are_refused_at_plan_time(tmp_path, lengths) -> None:
    from kvsieve.eval.config import ConfigError

    raw = {"model": "tiny-random", "output_dir": str(tmp_path),
           "tasks": {"acceptance": {"lengths": [160], "params": {"draft_lengths": lengths}}},
           "selectors": {"quest": {"budgets": [16], "params": {"page_size": 16}}}}
    with pytest.raises(ConfigError, match=r"tasks\.acceptance\.params: draft_lengths must be distinct values of "
                                          r"\[2, 4, 8\] including 4"):
        from_dict(raw)
    assert not (tmp_path / "summary.csv").exists()


def test_capped_rounds_accept_at_most_k() -> None:
    stats = AcceptanceStats(8, (1, 0, 2, 0, 0, 1, 0, 0, 3))
    assert _capped(stats, 2).histogram == (1, 0, 6)
    assert _capped(stats, 8) == stats


def test_the_rounds_match_a_speculative_session_at_k8(tiny) -> None:
    """The task's rounds at K = 8 are a speculative session's rounds (greedy, one row): the same
    accepted drafts, round by round."""
    ids = torch.tensor([tiny.tokenizer.encode("The printing press changed how ideas travelled. " * 5)])
    cfg = SparseAttentionConfig("quest", {"budget": 16, "page_size": 16})
    with KvsieveSession(tiny.model, cfg, speculate=8) as session:
        expected = session.speculative_generate(ids, AcceptanceTask.max_new_tokens).acceptance
    with KvsieveSession(tiny.model, cfg) as session:
        row = AcceptanceTask().run(session, session.prefill(ids), ids, None, None, tiny.tokenizer)
    assert row["accepted_length_k8"] == pytest.approx(expected.mean_accepted_length)
    assert row["acceptance_by_position_k8"] == "|".join(f"{a:.4f}" for a in expected.acceptance_by_position)


def test_the_lossless_page_config_plans_acceptance_runs(tmp_path) -> None:
    import re
    from pathlib import Path

    import yaml

    from kvsieve.eval.run_plan import plan_runs

    text = (Path(__file__).parents[2] / "docs" / "lossless.md").read_text(encoding="utf-8")
    raw = yaml.safe_load(re.search(r"```yaml\n(.*?)```", text, re.S).group(1))
    cells = plan_runs(from_dict({"model": "tiny-random", "output_dir": str(tmp_path), **raw}), "tiny")
    runs = [r for cell in cells for r in cell]
    assert {r.task.name for r in runs} == {"acceptance"} and {r.length for r in runs} == {2048, 8192}
    assert {r.label for r in runs if r.selector is not None} == {"quest"}
