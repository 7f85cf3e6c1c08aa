"""Faults inside vLLM's workers end the engine with a named error, not a hang (issue 43, item 3).

A third-party-style selector (``faulty``, written here as its own distribution on ``PYTHONPATH``:
a module and a ``.dist-info`` with a ``kvsieve.selectors`` entry point, so every vLLM process finds
it as it finds an installed one) counts its ``predict_attn`` calls and, on the ``fail_at``-th:

* raises: vLLM's offline engine (its engine core in its own process, vLLM's default) ends with the
  plug-in's :class:`~kvsieve.integrations.vllm.step.SelectorFailed`, naming the selector, the layer,
  the worker and the exception;
* with ``exit_rank=1``, under tensor parallelism (2 workers, ``mp`` executor, on the tiny Gemma 3 of
  ``test_parallel.py``): tensor-parallel rank 1 calls ``os._exit(17)``; vLLM's worker monitor
  reports the dead worker by name (``Worker proc VllmWorker-1 died unexpectedly (exit code: 17)``)
  and the engine ends — vLLM's own report, nothing added by the plug-in. vLLM reads the exit code as
  soon as the worker's sentinel pipe closes, which can be before the kernel has reaped the process:
  the code is then ``None`` (a process that ``os._exit``-s holding 200 MB read ``None`` in 19 of 30
  tries here), so the test takes 17 or ``None``.

Each engine runs in its own session (process group) under a bound; past it the group is killed and
the test fails saying it hung.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.platforms", reason="vLLM is not installed (it runs in its own venv, see .ci/run)")

import test_engine  # noqa: E402
from test_engine import HERE, _env  # noqa: E402
from test_parallel import write_tiny_gemma3  # noqa: E402

model_dir = test_engine.model_dir  # the fixture: SmolLM2-135M converted once

FAULT_TIMEOUT_S = 420  # an engine start is ~30-60 s here; a hang is anything past this
EXIT_CODE = 17

FAULTY = '''"""A selector that fails on purpose: dense until its fail_at-th predict_attn call (counted per
process), then raises, or, in the worker of tensor-parallel rank exit_rank, exits the process."""
import os
from dataclasses import dataclass

from kvsieve import Capabilities, SelectorInputs, SparseRuntimeParams, SparseSelector


@dataclass(frozen=True)
class FaultyConfig:
    fail_at: int = 3
    exit_rank: int = -1


class FaultySelector(SparseSelector):
    name = "faulty"
    config_class = FaultyConfig
    capabilities = Capabilities(phases=frozenset({"generation"}), per_kv_head=True)

    def __init__(self, config=None, **overrides):
        super().__init__(config, **overrides)
        self.calls = 0

    def predict_attn(self, inputs: SelectorInputs) -> SparseRuntimeParams | None:
        self.calls += 1
        if self.calls == self.config.fail_at:
            if self.config.exit_rank < 0:
                raise RuntimeError(f"faulty selector: call {self.calls} fails on purpose")
            from vllm.distributed import get_tensor_model_parallel_rank

            if get_tensor_model_parallel_rank() == self.config.exit_rank:
                os._exit(%d)
        return None
''' % EXIT_CODE


def _faulty_distribution(folder: Path) -> Path:
    """``folder`` holding the ``faulty`` selector as an installed distribution would: its module and a
    ``kvsieve_faulty_selector-0.1.dist-info`` declaring the ``kvsieve.selectors`` entry point."""
    (folder / "kvsieve_faulty_selector.py").write_text(FAULTY)
    info = folder / "kvsieve_faulty_selector-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvsieve-faulty-selector\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[kvsieve.selectors]\nfaulty = kvsieve_faulty_selector:FaultySelector\n")
    return folder


def _run_bounded(model: Path, out: Path, args: tuple[str, ...], env: dict[str, str]) -> tuple[int, str]:
    """run_engine.py in its own process group -> (exit status, stdout + stderr); the group is killed and
    the test fails when it has not ended in :data:`FAULT_TIMEOUT_S`."""
    cmd = [sys.executable, str(HERE / "run_engine.py"), str(model), str(out), *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=FAULT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=60)
        pytest.fail(f"the engine hung: still running after {FAULT_TIMEOUT_S} s; its output ends:\n{output[-5000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever vLLM left in the group (engine core, workers)
        except ProcessLookupError:
            pass
    return proc.returncode, output


def _faulty_env(tmp_path: Path, spec: str, **extra: str | None) -> dict[str, str]:
    dist = _faulty_distribution(tmp_path)
    path = os.pathsep.join(filter(None, [str(dist), os.environ.get("PYTHONPATH")]))
    return _env(KVSIEVE_SELECTOR=spec, PYTHONPATH=path, **extra)


def test_selector_raising_in_worker_ends_engine_with_named_error(model_dir, tmp_path):
    env = _faulty_env(tmp_path, "faulty:fail_at=3", VLLM_ENABLE_V1_MULTIPROCESSING=None)  # vLLM's default: 1
    rc, output = _run_bounded(model_dir, tmp_path / "out.json", ("--max-tokens", "4"), env)
    assert rc != 0 and not (tmp_path / "out.json").exists(), output[-5000:]
    assert ("SelectorFailed: kvsieve vLLM plug-in: selector 'faulty' raised in layer " in output
            and "(worker tensor-parallel rank 0 of 1, pipeline stage 0 of 1): RuntimeError: faulty selector: call 3 "
                "fails on purpose" in output), output[-5000:]


def test_tensor_parallel_worker_that_dies_is_reported_by_name(model_dir, tmp_path):
    model = write_tiny_gemma3(tmp_path / "tiny-gemma3", model_dir)
    env = _faulty_env(tmp_path, "faulty:fail_at=2,exit_rank=1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                      VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_CPU_KVCACHE_SPACE=None)
    args = ("--max-tokens", "4", "--dtype", "float32", "--tensor-parallel-size", "2", "--kv-cache-mib", "256",
            "--max-num-batched-tokens", "2048")
    rc, output = _run_bounded(model, tmp_path / "out.json", args, env)
    assert rc != 0 and not (tmp_path / "out.json").exists(), output[-5000:]
    reports = [line for line in output.splitlines() if "died unexpectedly" in line]
    assert any(re.search(rf"Worker proc VllmWorker-1 died unexpectedly \(exit code: ({EXIT_CODE}|None)\)", line)
               for line in reports), (reports, output[-5000:])
