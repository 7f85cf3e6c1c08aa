"""Resume keyed by the resolved config: which changes reuse which runs; corrupted files named and
rerun; failures recorded and the sweep going on; finished samples of an interrupted run kept.
All on the tiny random Llama (a few seconds per sweep)."""
from __future__ import annotations

import csv
import json
import shutil

import pytest

from kvsieve.eval import run_plan, runner
from kvsieve.eval.config import EvalConfig, apply_overrides, from_dict
from kvsieve.eval.model import load_model
from kvsieve.eval.runner import SweepInterrupted, run_sweep
from kvsieve.eval.store import write_csv

BASE = {
    "model": "tiny-random", "seed": 0,
    "tasks": {"passkey": {"lengths": [300], "depths": [50], "samples": 1},
              "fidelity": {"lengths": [100], "samples": 2}},
    "selectors": {"oracle_topk": {"budgets": [8]}, "streaming": {"budgets": [16], "params": {"num_sink": 2}}},
}
PASSKEY = ["passkey__300__tiny-random-llama__dense__full", "passkey__300__tiny-random-llama__oracle_topk__b8",
           "passkey__300__tiny-random-llama__streaming__b16"]
FIDELITY = [f.replace("passkey__300", "fidelity__100") for f in PASSKEY]
ALL = PASSKEY + FIDELITY


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tiny):
    out = tmp_path_factory.mktemp("base")
    run_sweep(from_dict({**BASE, "output_dir": str(out)}), loaded=tiny, progress=False, log=lambda _: None)
    return out


def _sweep(out, tiny, overrides=(), **kw):
    logs: list[str] = []
    cfg = from_dict(apply_overrides({**BASE, "output_dir": str(out)}, list(overrides)))
    result = run_sweep(cfg, loaded=tiny, progress=False, log=logs.append, **kw)
    return result, "\n".join(logs)


def _ids(out, folders):
    return {f: json.loads((out / f / "metrics.json").read_text())["run_id"] for f in folders}


# change -> (runs reused, runs rerun because their config changed, new runs)
MATRIX = {
    "nothing": ([], ALL, [], []),
    "seed": (["seed=7"], [], ALL, []),
    "backend": ([f"backend={'vanilla' if EvalConfig().backend != 'vanilla' else 'torch'}"], [], ALL, []),
    "task samples": (["tasks.passkey.samples=2"], FIDELITY, PASSKEY, []),
    "task depths": (["tasks.passkey.depths=[40]"], FIDELITY, PASSKEY, []),
    "selector param": (["selectors.streaming.params.num_sink=3"], [PASSKEY[0], PASSKEY[1], FIDELITY[0], FIDELITY[1]],
                       [PASSKEY[2], FIDELITY[2]], []),
    "budget added": (["selectors.oracle_topk.budgets=[8, 12]"], ALL, [],
                     [PASSKEY[1].replace("b8", "b12"), FIDELITY[1].replace("b8", "b12")]),
    "length added": (["tasks.fidelity.lengths=[100, 120]"], ALL, [],
                     [f.replace("fidelity__100", "fidelity__120") for f in FIDELITY]),
    "threads (result-neutral)": (["threads=1"], ALL, [], []),
}


@pytest.mark.parametrize("change", list(MATRIX))
def test_resume_matrix(change, base_dir, tiny, tmp_path):
    overrides, reused, changed, new = MATRIX[change]
    out = tmp_path / "out"
    shutil.copytree(base_dir, out)
    before = _ids(out, ALL)
    result, log = _sweep(out, tiny, overrides)
    assert result.counts.get("done", 0) == len(reused)
    assert result.counts.get("changed", 0) == len(changed)
    assert result.counts.get("new", 0) == len(new)
    assert f"{len(reused)} reused, {len(new)} new, {len(changed)} rerun" in log
    after = _ids(out, ALL + new)
    assert {f: after[f] for f in reused} == {f: before[f] for f in reused}
    assert all(after[f] != before[f] for f in changed)
    for f in changed:
        assert f"{f}: config changed:" in log
    with (out / "summary.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert sorted(r["folder"] for r in rows) == sorted(reused + changed + new)
    assert all(r["status"] == "ok" for r in rows)


def test_rerun_reason_names_the_changed_key(base_dir, tiny, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(base_dir, out)
    _, log = _sweep(out, tiny, ["seed=7"])
    assert "seed 0 -> 7" in log


def test_rerun_reason_compares_as_the_run_id_does():
    """config.yaml stores lists where the run's identity holds tuples: not a change."""
    from kvsieve.eval.store import diff_identity

    old = {"seed": 0, "sparse_config": {"phases": ["generation"], "dense_layers": []}}
    new = {"seed": 1, "sparse_config": {"phases": ("generation",), "dense_layers": ()}}
    assert diff_identity(old, new) == "seed 0 -> 1"


def test_kvsieve_version_is_part_of_the_identity(base_dir, tiny, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(base_dir, out)
    monkeypatch.setattr(run_plan, "__version__", "9.9.9")  # the identity's version (run_plan.run_identity)
    result, log = _sweep(out, tiny)
    assert result.counts == {"changed": len(ALL)} and "kvsieve_version 0.1.0 -> 9.9.9" in log


@pytest.mark.parametrize("damage", ["empty metrics", "metrics without run_id", "short predictions",
                                    "garbage partial"])
def test_corrupt_files_are_named_and_rerun(damage, base_dir, tiny, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(base_dir, out)
    victim = out / PASSKEY[1]
    if damage == "empty metrics":
        (victim / "metrics.json").write_text("")
        name = "metrics.json is unreadable"
    elif damage == "metrics without run_id":
        m = json.loads((victim / "metrics.json").read_text())
        del m["run_id"]
        (victim / "metrics.json").write_text(json.dumps(m))
        name = "metrics.json lacks ['run_id']"
    elif damage == "short predictions":
        (victim / "predictions.csv").write_text("sample\n")
        name = "predictions.csv has 0 rows, metrics.json says n=1"
    else:
        (victim / "metrics.json").unlink()
        (victim / "partial.json").write_text("{not json")
        name = "partial.json is unreadable"
    result, log = _sweep(out, tiny)
    assert result.counts == {"done": len(ALL) - 1, "corrupt": 1}
    assert f"{PASSKEY[1]}: {victim}" in log and name in log
    assert json.loads((victim / "metrics.json").read_text())["n"] == 1
    assert not (victim / "partial.json").exists()


def _failing_execute(labels, exc=RuntimeError, after_samples=0):
    """Wrap runner._execute so runs whose label is in ``labels`` raise ``exc`` once they have
    finished ``after_samples`` samples of a cell."""
    real = runner._execute
    seen: dict[str, int] = {}

    def execute(session, task, run, ids, prefix, sample, *rest):
        if run.label in labels:
            seen[run.folder] = seen.get(run.folder, 0) + 1
            if seen[run.folder] > after_samples:
                raise exc("injected failure")
        return real(session, task, run, ids, prefix, sample, *rest)

    return execute


def test_failed_run_is_recorded_and_the_sweep_goes_on(tmp_path, tiny, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(runner, "_execute", _failing_execute({"streaming"}))
    result, log = _sweep(out, tiny)
    failed = {PASSKEY[2], FIDELITY[2]}
    assert result.failed == 2
    for f in failed:
        text = (out / f / "error.txt").read_text()
        assert "RuntimeError: injected failure" in text and "Traceback (most recent call last)" in text
        assert not (out / f / "metrics.json").exists()
        assert f"run {f} failed: RuntimeError: injected failure" in log
    with (out / "summary.csv").open() as fh:
        rows = {r["folder"]: r for r in csv.DictReader(fh)}
    assert {f for f, r in rows.items() if r["status"] == "failed"} == failed
    assert all(rows[f]["status"] == "ok" and rows[f]["score"] != "" for f in set(ALL) - failed)
    assert rows[PASSKEY[2]]["error"] == "RuntimeError: injected failure"
    report = (out / "report.md").read_text()
    assert f"]({PASSKEY[2]}/error.txt): RuntimeError: injected failure" in report
    # the next sweep reruns the failed runs only, saying why
    monkeypatch.undo()
    result, log = _sweep(out, tiny)
    assert result.counts == {"done": 4, "failed": 2} and result.failed == 0
    assert f"{PASSKEY[2]}: failed before (RuntimeError: injected failure)" in log
    assert not (out / PASSKEY[2] / "error.txt").exists()


def test_fail_fast_stops_at_the_first_failure(tmp_path, tiny, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(runner, "_execute", _failing_execute({"oracle_topk"}))
    with pytest.raises(RuntimeError, match="injected failure"):
        _sweep(out, tiny, fail_fast=True)
    assert (out / PASSKEY[1] / "error.txt").is_file()
    assert not (out / PASSKEY[2] / "metrics.json").exists()  # never reached


def test_interrupt_keeps_finished_samples(tmp_path, tiny, monkeypatch):
    """Ctrl-C in the streaming run's second fidelity sample: its first sample is in partial.json,
    summary.csv lists the five finished runs, and the resume computes only its sample 2."""
    out = tmp_path / "out"
    monkeypatch.setattr(runner, "_execute", _failing_execute({"streaming"}, KeyboardInterrupt, after_samples=1))
    with pytest.raises(SweepInterrupted) as info:
        _sweep(out, tiny)
    assert info.value.done == 5 and info.value.partial_samples == 1  # passkey x3 + fidelity dense/oracle done
    partial = json.loads((out / FIDELITY[2] / "partial.json").read_text())
    assert len(partial["rows"]) == 1
    with (out / "summary.csv").open() as fh:
        assert len(list(csv.DictReader(fh))) == 5
    monkeypatch.undo()
    calls: list[str] = []
    real = runner._execute

    def counting(session, task, run, *rest):
        calls.append(run.folder)
        return real(session, task, run, *rest)

    monkeypatch.setattr(runner, "_execute", counting)
    result, log = _sweep(out, tiny)
    assert result.counts == {"done": 5, "partial": 1}
    assert f"{FIDELITY[2]}: resumed after 1 finished samples" in log
    # sample 2 of the streaming run, plus the dense run as its KL reference (not re-recorded)
    assert calls == [FIDELITY[0], FIDELITY[2]]
    assert json.loads((out / FIDELITY[2] / "metrics.json").read_text())["n"] == 2


def test_a_prediction_holding_a_carriage_return_reads_back(tmp_path):
    """A random model's answer held a bare \\r, which split its predictions.csv row in two (the run
    then read as corrupt and was redone on every resume)."""
    rows = [{"sample": 0, "prediction": "a\rb"}, {"sample": 1, "prediction": "c\nd\r\ne"}]
    write_csv(tmp_path / "p.csv", rows, ["sample", "prediction"])
    with open(tmp_path / "p.csv", newline="", encoding="utf-8") as f:
        assert [r["prediction"] for r in csv.DictReader(f)] == ["a\rb", "c\nd\r\ne"]
