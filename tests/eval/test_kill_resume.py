"""A real ``kvsieve eval`` process on the tiny random Llama, killed with SIGKILL at random points of
its sweep and resumed, ends with the same summary.csv, byte for byte, as an uninterrupted run; a
SIGINT ends it with one line saying what was saved and the exact command that resumes."""
from __future__ import annotations

import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kvsieve.eval.store import METRICS

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {
    "model": "tiny-random", "seed": 0,
    "tasks": {"passkey": {"lengths": [300], "depths": [30, 70], "samples": 1},
              "fidelity": {"lengths": [100], "samples": 2}},
    "selectors": {"oracle_topk": {"budgets": [8, 16]}, "streaming": {"budgets": [16], "params": {"num_sink": 2}}},
}
PLAN_LINE = "kvsieve eval: 8 runs"


def _start(cfg_path: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "kvsieve.cli", "eval", "--config", str(cfg_path), "--output-dir", str(out),
           "--no-progress"]
    # a shell without job control starts background jobs with SIGINT ignored, and Python then
    # installs no KeyboardInterrupt handler: give the sweep the default disposition, as a terminal would
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for_plan(proc: subprocess.Popen) -> float:
    """Read stdout until the sweep's plan line; returns the time it appeared."""
    for line in proc.stdout:
        if line.startswith(PLAN_LINE):
            return time.monotonic()
    raise AssertionError(f"no plan line; stderr: {proc.stderr.read()}")


@pytest.fixture(scope="module")
def cfg_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "sweep.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    return path


@pytest.fixture(scope="module")
def uninterrupted(cfg_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    proc = _start(cfg_path, out)
    t0 = _wait_for_plan(proc)
    rest, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return out, time.monotonic() - t0


def test_sigkill_at_random_points_then_resume_gives_the_same_summary(cfg_path, uninterrupted, tmp_path):
    whole, sweep_seconds = uninterrupted
    out = tmp_path / "killed"
    rng = random.Random(14)
    for _ in range(2):
        proc = _start(cfg_path, out)
        _wait_for_plan(proc)
        time.sleep(rng.uniform(0.0, sweep_seconds))
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    proc = _start(cfg_path, out)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert (out / "summary.csv").read_bytes() == (whole / "summary.csv").read_bytes()
    assert not list(out.rglob("partial.json")) and not list(out.rglob("*.tmp"))


def test_sigint_says_what_was_saved_and_how_to_resume(cfg_path, uninterrupted, tmp_path):
    whole, _ = uninterrupted
    out = tmp_path / "interrupted"
    proc = _start(cfg_path, out)
    _wait_for_plan(proc)
    # once the first of its 8 runs is saved, the sweep is surely still running however busy the machine
    # (a sleep measured against another run could outlast a sweep that runs faster this time)
    while not any(out.rglob(METRICS)):
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvsieve eval: interrupted; saved ")
    assert f"under {out}" in lines[0]
    resume = lines[0].split("resume with: ", 1)[1]
    cd, command = resume.split(" && ")
    assert shlex.split(cd) == ["cd", str(ROOT)]
    args = shlex.split(command)
    assert args[:2] == ["kvsieve", "eval"]
    # the printed command, run as printed (through this checkout's module rather than the installed script)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "kvsieve.cli", *args[1:]], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert (out / "summary.csv").read_bytes() == (whole / "summary.csv").read_bytes()
