"""``kvsieve eval --engine vllm`` end to end on CPU with SmolLM2-135M (CI-sized: one short cell, two
prompts, two engines): the eval's prompts through vLLM's own attention and through the plug-in
with Quest, budgets set per request.

* dense through the plug-in (``{"dense": true}`` per request) answers every prompt as vLLM's own
  attention does, and so does a Quest budget covering the whole context;
* an essay continuation is scored against vLLM's own attention's continuation of the same prompt;
* every row has a positive decode speed-up against vLLM's own attention, measured in the run;
* report.md shows the frontier plot (score against decode speed-up);
* the ``acceptance`` task runs as lossless decoding in vLLM (kvsieve's drafter, at K = 4 only: one
  engine per run, where the default K = 2, 4, 8 start three): accepted lengths within [1, K + 1], a
  covering budget's drafts accepted at least as often as the 32-token budget's and its tokens vLLM's
  own, a measured lossless speed-up;
* a rerun reuses every run (no engine started) and the engine is part of each run's identity.
"""
from __future__ import annotations

import csv
from pathlib import Path

import pytest
import yaml

pytest.importorskip("vllm.platforms", reason="vLLM is not installed (it runs in its own venv, see .ci/run)")

LENGTH = 256
COVERING = 384  # whole pages of 16 covering the prompt and the answer


def _config(out: Path) -> dict:
    return {"model": "smollm2", "engine": "vllm", "output_dir": str(out),
            "tasks": {"passkey": {"lengths": [LENGTH], "depths": [25, 75], "samples": 1},
                      "essay_continuation": {"lengths": [LENGTH], "samples": 2},
                      "acceptance": {"lengths": [LENGTH], "samples": 1, "params": {"draft_lengths": [4]}}},
            "selectors": {"quest": {"budgets": [32, COVERING], "params": {"page_size": 16}}}}


def _answers(out: Path, folder: str) -> list[str]:
    with (out / folder / "predictions.csv").open(encoding="utf-8", newline="") as f:
        return [r["prediction"] for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    from kvsieve.eval.config import from_dict
    from kvsieve.eval.runner import run_sweep

    out = tmp_path_factory.mktemp("served")
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    lines: list[str] = []
    try:
        first = run_sweep(from_dict(_config(out)), progress=False, log=lines.append)
        again: list[str] = []
        second = run_sweep(from_dict(_config(out)), progress=False, log=again.append)
    finally:
        mp.undo()
    return out, first, second, lines, again


def test_every_run_finishes(sweep):
    out, first, _, lines, _ = sweep
    assert first.failed == 0, "\n".join(lines)
    for task in ("passkey", "essay_continuation"):
        assert {r["selector"] + "/" + r["budget_label"] for r in first.rows if r["task"] == task} == {
            "dense/full", "quest/b32", f"quest/b{COVERING}", "quest/dense"}


def test_a_continuation_is_scored_against_vllms_own_attention(sweep):
    """The dense run is its own reference; dense attention through the plug-in and a covering budget
    continue exactly as vLLM's own attention does, so every token matches."""
    _, first, _, _, _ = sweep
    score = {r["selector"] + "/" + r["budget_label"]: float(r["score"]) for r in first.rows
             if r["task"] == "essay_continuation"}
    assert score.pop("dense/full") == score.pop("quest/dense") == score.pop(f"quest/b{COVERING}") == 1.0
    assert 0.0 <= score.pop("quest/b32") <= 1.0


def test_dense_through_the_plugin_and_a_covering_budget_answer_as_vllms_own_attention(sweep):
    out, first, _, _, _ = sweep
    folder = {r["selector"] + "/" + r["budget_label"]: r["folder"] for r in first.rows if r["task"] == "passkey"}
    own = _answers(out, folder["dense/full"])
    assert len(own) == 2 and all(own)
    assert _answers(out, folder["quest/dense"]) == own
    assert _answers(out, folder[f"quest/b{COVERING}"]) == own


def test_every_row_has_a_decode_speedup_and_the_report_shows_the_frontier(sweep):
    out, first, _, _, _ = sweep
    for r in first.rows:
        assert float(r["decode_speedup"]) > 0, r
        assert float(r["decode_tok_s"]) > 0 and float(r["own_decode_tok_s"]) > 0, r
    assert next(r for r in first.rows if r["selector"] == "dense")["decode_speedup"] == 1.0  # the baseline
    with (out / "summary.csv").open(encoding="utf-8", newline="") as f:
        assert "decode_speedup" in next(csv.reader(f))
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "](frontier__passkey.png)" in report and (out / "frontier__passkey.png").stat().st_size > 0
    assert "decode speed-up" in report


def test_acceptance_is_measured_as_lossless_decoding_in_vllm(sweep):
    out, first, _, _, _ = sweep
    rows = {r["selector"] + "/" + r["budget_label"]: r for r in first.rows if r["task"] == "acceptance"}
    assert set(rows) == {"dense/full", "quest/b32", f"quest/b{COVERING}", "quest/dense"}
    assert float(rows["dense/full"]["score"]) == 1.0 and float(rows["dense/full"]["decode_speedup"]) == 1.0
    for label in ("quest/b32", f"quest/b{COVERING}"):
        r = rows[label]
        assert 1.0 <= float(r["accepted_length_k4"]) <= 5.0 and float(r["score"]) == float(r["accepted_length_k4"]), r
        assert float(r["lossless_speedup_k4"]) > 0 and r["lossless_speedup_k2"] is r["lossless_speedup_k8"] is None, r
    covering = rows[f"quest/b{COVERING}"]
    assert float(covering["accepted_length_k4"]) >= float(rows["quest/b32"]["accepted_length_k4"])
    with (out / covering["folder"] / "predictions.csv").open(encoding="utf-8", newline="") as f:
        assert [int(p["tokens_equal_own"]) for p in csv.DictReader(f)] == [1]  # drafts over the whole context


def test_a_rerun_reuses_every_run_and_the_engine_is_in_each_runs_identity(sweep):
    out, first, second, _, again = sweep
    assert second.counts == {"done": len(first.rows)}
    assert not any("starting vLLM engine" in line for line in again)
    assert [r["run_id"] for r in second.rows] == [r["run_id"] for r in first.rows]
    for r in first.rows:
        identity = yaml.safe_load((out / r["folder"] / "config.yaml").read_text(encoding="utf-8"))["identity"]
        assert identity["engine"]["name"] == "vllm"
