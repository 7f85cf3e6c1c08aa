"""The vLLM sweep's cells (:func:`kvsieve.eval.served.sweep._generate_cell`) without vLLM: an engine
that records its requests shows a cell's runs answered prompt-major (each wave of prompts in every
run's setting back to back, so settings that keep a dense prompt cache share the wave's prefills),
the salt only on a prompt-selecting entry's budgets, and each run's rows assembled from its own
answers; a cell whose generation fails fails every one of its runs (the real engines:
tests/vllm/test_eval_served.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvsieve.eval.config import SelectorSpec, TaskSpec
from kvsieve.eval.run_plan import RunSpec
from kvsieve.eval.served import sweep
from kvsieve.eval.served.protocol import MAX_NUM_SEQS
from kvsieve.eval.tasks import Sample

LENGTH, N = 1024, MAX_NUM_SEQS + 2  # two waves, the second partial


class RecordingEngine:
    """Answers ``generate`` with the digits of each prompt's first id, spelled out, and records every
    request's (first ids, setting, salt)."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[list[int], object, object]] = []
        self.fail = fail

    def request(self, job):
        assert job["op"] == "generate"
        self.calls.append(([p["ids"][0] for p in job["prompts"]], job["prompts"][0]["setting"],
                           job["prompts"][0]["salt"]))
        if self.fail:
            raise RuntimeError("engine gone")
        return {"tokens": [[p["ids"][0]] for p in job["prompts"]]}


class DigitTokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=False):
        return "".join(str(i) for i in ids)


def _sweep():
    task = TaskSpec(name="passkey", lengths=[LENGTH], depths=[50], samples=N)
    samples = [Sample(index=i, prompt="", answers=[str(100 + i)], depth=50.0) for i in range(N)]
    sw = SimpleNamespace(lm=SimpleNamespace(tokenizer=DigitTokenizer()), prompts={
        ("passkey", LENGTH): [(s, [100 + s.index] + [7] * 8) for s in samples]})
    return sw, task


def _runs(task, spec):
    return [RunSpec(task, LENGTH, "m", spec, b) for b in spec.resolve(LENGTH)]


def test_a_cells_runs_are_answered_prompt_major_and_rows_are_each_runs_own():
    sw, task = _sweep()
    spec = SelectorSpec(label="quest", selector="quest", budgets=[32, 64], params={"page_size": 16},
                        phases=["generation"])
    runs = _runs(task, spec)
    engine = RecordingEngine()
    made = sweep._generate_cell(sw, RecordingEngine(), engine, runs)
    first_wave = [100 + i for i in range(MAX_NUM_SEQS)]
    second_wave = [100 + i for i in range(MAX_NUM_SEQS, N)]
    settings = [sweep.request_setting(r.budget) for r in runs]
    assert [(ids, setting) for ids, setting, _ in engine.calls] == (
        [(first_wave, s) for s in settings] + [(second_wave, s) for s in settings])
    assert all(salt is None for _, _, salt in engine.calls)  # decode-only: one prompt cache for every setting
    for run in runs:
        rows = made[run.folder].rows
        assert [r["sample"] for r in rows] == list(range(N))
        assert all(r["score"] == 1.0 for r in rows)  # each prompt's answer is its own passkey


def test_a_prompt_selecting_entry_salts_each_budget():
    sw, task = _sweep()
    spec = SelectorSpec(label="bs", selector="block_select", budgets=[32, 64],
                        params={"block_size": 16, "init_blocks": 0, "local_blocks": 1}, phases=["context", "generation"])
    engine = RecordingEngine()
    sweep._generate_cell(sw, RecordingEngine(), engine, _runs(task, spec))
    salts = {salt for _, _, salt in engine.calls}
    assert None not in salts and len(salts) == 2  # one prompt cache per setting


def test_a_failed_cell_fails_each_of_its_runs(monkeypatch):
    sw, task = _sweep()
    spec = SelectorSpec(label="quest", selector="quest", budgets=[32, 64], params={"page_size": 16},
                        phases=["generation"])
    runs = _runs(task, spec)
    finished: dict[str, object] = {}

    def fake_finish(sw_, run, measure):
        try:
            finished[run.folder] = measure()
        except RuntimeError as err:
            finished[run.folder] = err

    monkeypatch.setattr(sweep, "_finish", fake_finish)
    sweep._finish_generated(sw, RecordingEngine(), RecordingEngine(fail=True), runs)
    assert set(finished) == {r.folder for r in runs}
    assert all(isinstance(v, RuntimeError) and "engine gone" in str(v) for v in finished.values())
    with pytest.raises(RuntimeError, match="engine gone"):
        sweep._made({}, RuntimeError("engine gone"), runs[0])
