"""benchmarks/vllm_lossless.py without vLLM: the token check (it fails on a difference that is not a
rounding tie), the spec-decode counters' summary and the table's ratios and cost model against
hand-worked values (the engines themselves: tests/vllm/)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the benchmarks package lives at the repository root
    sys.path.insert(0, str(ROOT))

from benchmarks.vllm_lossless import OWN, ProposeTimer, check_tokens, main, spec_summary, table, tie_tolerance  # noqa: E402
from kvsieve.eval.served.launch import EngineLaunch, split_speculation  # noqa: E402
from kvsieve.eval.served.worker import spec_delta  # noqa: E402


def _base(tokens, gaps, rep=0, step_ms=100.0, tok_s=10.0, top=20.0):
    """The baseline's row: its top logit ``top`` at every position, the second ``gap`` below it."""
    return {"mode": OWN, "rep": rep, "prompt_tokens": 64, "concurrency": len(tokens), "tokens": tokens,
            "top2_logits": [[[top, top - g] for g in request] for request in gaps], "step_ms": step_ms,
            "decode_tok_s": tok_s}


def test_the_lossless_mode_syntax_and_its_refusals():
    assert split_speculation("quest:budget=512,page_size=16@4") == ("quest:budget=512,page_size=16", 4)
    assert split_speculation("quest:budget=512") == ("quest:budget=512", None)
    launch = EngineLaunch("quest:budget=512@2")
    assert launch.speculative_config() == {"method": "custom_class", "num_speculative_tokens": 2,
                                           "model": "kvsieve.integrations.vllm.drafter.SparseDrafter"}
    assert launch.env(base={})["KVSIEVE_SELECTOR"] == "quest:budget=512"
    assert EngineLaunch("quest:budget=512").speculative_config() is None
    for bad in ("own@2", "dense@8", "@4", "quest:budget=512@0", "quest:budget=512@x"):
        with pytest.raises(ValueError, match="mode"):
            EngineLaunch(bad)


def test_identical_tokens_pass_and_longer_runs_compare_their_common_part():
    base = _base([[1, 2, 3], [4, 5]], [[5.0] * 3, [5.0] * 2])
    assert check_tokens(base, {"tokens": [[1, 2, 3, 9, 9], [4, 5, 6]]}) == []


def test_a_difference_fails_unless_the_baseline_was_a_rounding_tie():
    base = _base([[1, 2, 3], [4, 5, 6]], [[5.0, 5.0, 5.0], [5.0, 1e-5, 5.0]])
    assert check_tokens(base, {"tokens": [[1, 2, 3], [4, 7, 6]]}) == []  # request 1 differs at a tie
    problems = check_tokens(base, {"tokens": [[1, 8, 3], [4, 5, 6]]})
    assert len(problems) == 1 and "request 0, token 1" in problems[0] and "not a rounding tie" in problems[0]


def test_in_bf16_neighbouring_logits_are_a_tie_and_two_steps_are_not():
    """bf16 keeps 8 significant bits: between 16 and 32 its values are 0.125 apart, between 1 and 2
    0.0078125 apart. A gap of one step at the top logit is a tie in bf16, not in fp32; two steps never."""
    assert tie_tolerance(20.0, "bfloat16") == 0.125 and tie_tolerance(-20.0, "bfloat16") == 0.125
    assert tie_tolerance(1.5, "bfloat16") == 2.0 ** -7
    assert tie_tolerance(20.0, "float32") == 1e-3 and tie_tolerance(0.0, "bfloat16") == 1e-3
    with pytest.raises(ValueError, match="no rounding-tie rule for dtype 'float16'"):
        tie_tolerance(20.0, "float16")
    base = _base([[1, 2, 3]], [[5.0, 0.125, 5.0]], top=20.0)
    assert check_tokens(base, {"tokens": [[1, 9, 3]]}, dtype="bfloat16") == []
    assert "not a rounding tie" in check_tokens(base, {"tokens": [[1, 9, 3]]}, dtype="float32")[0]
    two_steps = _base([[1, 2, 3]], [[5.0, 0.25, 5.0]], top=20.0)
    assert "0.25 apart" in check_tokens(two_steps, {"tokens": [[1, 9, 3]]}, dtype="bfloat16")[0]
    wider = _base([[1, 2, 3]], [[5.0, 0.002, 5.0]])  # --tie widens the fp32 rule
    assert check_tokens(wider, {"tokens": [[1, 9, 3]]}, tie=0.01) == []
    rows = [{**wider, "mode": OWN}, {**wider, "mode": "quest:budget=64@2", "tokens": [[1, 9, 3]],
                                     "mean_accepted_length": 2.0, "draft_ms": 50.0, "verify_ms": 50.0,
                                     "acceptance_by_position": [0.5, 0.5]}]
    assert table(rows, tie=0.01)[1]["tokens"] == "own's (1 requests differ at a rounding tie)"
    assert table(rows)[1]["tokens"].startswith("MISMATCH: request 0, token 1")


def test_spec_summary_from_counter_differences():
    before = {"drafts": 10.0, "accepted": 20.0, "per_position": [8.0, 6.0, 4.0, 2.0]}
    after = {"drafts": 30.0, "accepted": 70.0, "per_position": [26.0, 20.0, 14.0, 10.0]}
    got = spec_summary(spec_delta(before, after))
    assert got["drafts"] == 20 and got["mean_accepted_length"] == pytest.approx(1 + 50 / 20)
    assert got["acceptance_by_position"] == [0.9, 0.7, 0.5, 0.4]
    assert spec_summary(spec_delta(after, after)) == {"drafts": 0}


def test_table_ratios_cost_model_and_a_mismatch_flagged():
    base = _base([[1, 2, 3]], [[5.0, 5.0, 5.0]], step_ms=100.0, tok_s=10.0)
    spec = {"mode": "quest:budget=64@2", "rep": 0, "prompt_tokens": 64, "concurrency": 1, "tokens": [[1, 2, 3]],
            "decode_tok_s": 15.0, "step_ms": 160.0, "mean_accepted_length": 2.4, "draft_ms": 60.0,
            "verify_ms": 100.0, "acceptance_by_position": [0.8, 0.6]}
    wrong = {**spec, "mode": "quest:budget=64@4", "tokens": [[1, 9, 3]]}
    sparse = {**spec, "mode": "quest:budget=64", "tokens": [[1, 9, 3]]}
    rows = table([base, spec, wrong, sparse])
    by_mode = {r["mode"]: r for r in rows}
    assert by_mode[OWN]["x_own"] == 1.0
    assert by_mode["quest:budget=64@2"]["x_own"] == 1.5
    assert by_mode["quest:budget=64@2"]["cost_model"] == pytest.approx(2.4 * 100 / 160, abs=1e-3)
    assert by_mode["quest:budget=64@2"]["tokens"] == "own's"
    assert by_mode["quest:budget=64@4"]["tokens"].startswith("MISMATCH")
    assert "not lossless" in by_mode["quest:budget=64"]["tokens"]


def test_propose_timer_counts_the_wrapped_calls():
    class Drafter:
        def propose(self, x):
            return [x]

    timer = ProposeTimer(Drafter)
    assert Drafter().propose(3) == [3]
    assert timer.take() > 0.0 and timer.take() == 0.0


def test_main_exits_1_on_a_mismatch(monkeypatch, tmp_path):
    import benchmarks.vllm_lossless as bench

    rows = {OWN: {"tokens": [[1, 2, 3]], "top2_logits": [[[9.0, 4.0]] * 3], "step_ms": 100.0, "decode_tok_s": 10.0},
            "quest:budget=64@2": {"tokens": [[1, 7, 3]], "step_ms": 100.0, "decode_tok_s": 10.0,
                                  "mean_accepted_length": 2.0, "draft_ms": 50.0, "verify_ms": 50.0,
                                  "acceptance_by_position": [0.5, 0.5]}}

    class FakeEngine:
        def __init__(self, name, *a, **kw):
            self.name = name

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def send(self, line):
            self.line = line

        def read(self, prefix):
            import json
            return json.dumps({"rep": 0, "prompt_tokens": 64, "concurrency": 1, **rows[self.name]})

    monkeypatch.setattr(bench, "EngineProcess", FakeEngine)
    monkeypatch.setattr(bench, "model_folder", lambda spec: tmp_path)
    assert main(["--draft", "quest:budget=64", "--k", "2", "--reps", "1", "--lengths", "64", "--concurrency", "1",
                 "--out", str(tmp_path)]) == 1
