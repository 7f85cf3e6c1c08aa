"""The GPU verification driver on a machine without a GPU: the dry run really runs its CPU parts
(the kernel cases under the interpreter, the import check), reports the GPU steps as skipped with
the reason, writes the documented JSON/Markdown, refuses to run without ``--dry-run`` when there is
no GPU, and exits non-zero when a case mismatches (``--perturb`` makes the references wrong by 5%:
no GPU is mocked, the real comparison fails)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _driver(tmp: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "kvsieve.gpu_check", "--out", str(tmp), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=400)
    report = tmp / "gpu_check.json"
    return proc, json.loads(report.read_text()) if report.exists() else None


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: run the real check (tools/gpu_check.sh)")
    out = tmp_path_factory.mktemp("gpu_check_dry")
    proc, report = _driver(out, "--dry-run", "--cute-bundle", str(out / "no_bundle"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return report, (out / "gpu_check.md").read_text()


def test_dry_run_report_fields(dry_run):
    from kvsieve.gpu_check.driver import STEPS, TOTAL_BUDGET_S
    report, _ = dry_run
    meta = report["meta"]
    assert meta["dry_run"] is True and meta["total_budget_s"] == TOTAL_BUDGET_S < 480
    assert {"torch", "triton", "python", "gpu", "compute-sanitizer"} <= set(meta["environment"])
    assert meta["environment"]["torch"] == torch.__version__
    assert [s["name"] for s in report["steps"]] == [s.name for s in STEPS]
    assert sum(s.budget_s for s in STEPS) <= TOTAL_BUDGET_S
    assert report["ok"] is True
    for s in report["steps"]:
        assert {"status", "seconds", "budget_s", "reason", "what"} <= set(s)
        assert s["seconds"] <= s["budget_s"]


def test_dry_run_skips_gpu_steps_and_runs_cpu_ones(dry_run):
    from kvsieve.gpu_check.cases import SMALL
    steps = {s["name"]: s for s in dry_run[0]["steps"]}
    for name in ("gpu_tests", "benchmarks", "sanitizer", "cute_benchmarks"):
        assert steps[name]["status"] == "skipped" and steps[name]["reason"] == "dry run: needs a GPU"
    assert steps["imports"]["status"] == "pass"
    cases = steps["triton_cases"]
    assert cases["status"] == "pass"
    assert [c["name"] for c in cases["details"]] == list(SMALL)
    for c in cases["details"]:  # really compared: fp32 under the interpreter, finite error within tol
        assert c["passed"] and c["dtype"] == "float32" and 0 <= c["max_err"] <= c["tol"]
    # no bundle at the given path: skipped with the line that says how to build one
    assert steps["cute_aot"]["status"] == "skipped" and "kvsieve.kernels.aot.cute_bundle build" in steps["cute_aot"]["reason"]


def test_markdown_report(dry_run):
    md = dry_run[1]
    assert md.startswith("# kvsieve GPU check (dry run, no GPU)")
    for text in ("| step | what | status |", "| gpu_tests |", "## triton_cases", "| mla_decode |"):
        assert text in md


def test_mismatch_exits_nonzero(tmp_path):
    proc, report = _driver(tmp_path, "--dry-run", "--steps", "triton_cases", "--perturb", "0.05")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    step = report["steps"][0]
    assert report["ok"] is False and step["status"] == "fail"
    assert any(not c["passed"] for c in step["details"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_refuses_without_gpu_and_without_dry_run(tmp_path):
    proc, report = _driver(tmp_path)
    assert proc.returncode == 2 and report is None
    assert "--dry-run" in proc.stderr


def test_step_out_of_time_is_a_failure(tmp_path):
    from kvsieve.gpu_check.driver import STEPS, run_step
    r = run_step(STEPS[0], tmp_path, dry_run=True, gpu_ok=False, time_left=1.0, perturb=0.0,
                 cute_bundle=tmp_path)
    assert r.status == "timeout" and r.command == []


def test_timeout_kills_the_whole_step(tmp_path):
    """A step over its budget is stopped with its own children (a test's subprocess must not keep
    running into the next step)."""
    import time

    from kvsieve.gpu_check.driver import _run_bounded
    # the step starts a grandchild, says its pid, and would outlive any budget below
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(600)']); print(p.pid, flush=True); time.sleep(600)")
    for budget in (3.0, 6.0, 12.0, 24.0, 48.0):  # a loaded machine may not start both in 3 s: try longer
        text, rc = _run_bounded([sys.executable, "-c", code], dict(os.environ), budget)
        assert rc is None, f"the step ended on its own within {budget} s: {text}"  # so it was stopped
        if text.split():
            break
    else:
        raise AssertionError("the step never said its grandchild's pid")
    grandchild = int(text.split()[0])
    for _ in range(600):  # killed with the step; reaped by init soon after (a zombie is dead too)
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            return
        if Path(f"/proc/{grandchild}/stat").exists() and Path(f"/proc/{grandchild}/stat").read_text().split()[2] == "Z":
            return
        time.sleep(0.1)
    raise AssertionError(f"process {grandchild} still runs a minute after the step's timeout")


def test_markdown_benchmark_rows():
    """Benchmark rows render with their peaks; a failed kernel shows its error instead of figures."""
    from kvsieve.gpu_check.report import render_markdown
    bench = {"hbm_peak_tb_s": 4.8, "bf16_peak_tflops": 790.0, "copy_tb_s": 4.3, "matmul_tflops": 780.0,
             "rows": [{"kernel": "sparse_gqa_decode", "shape": "b=1", "ms": 0.5, "gb_s": 2400.0, "pct_hbm": 50.0,
                       "tflops": 1.5, "pct_flops": 0.2}, {"kernel": "cute mla fp8", "error": "RuntimeError: x"}]}
    step = {"name": "benchmarks", "what": "w", "status": "fail", "seconds": 1.0, "budget_s": 70, "reason": "exit 1",
            "details": bench}
    meta = {"dry_run": False, "date": "d", "wall_s": 1.0, "total_budget_s": 470, "perturb": 0.0,
            "environment": {"gpu": "NVIDIA H200"}}
    md = render_markdown({"meta": meta, "steps": [step], "ok": False})
    assert "Ceilings measured in this run: copy 4.30 TB/s, bf16 matmul 780 TFLOP/s." in md
    assert "| sparse_gqa_decode | b=1 | 0.500 | 2400 | 50 | 1.5 | 0.2 |" in md
    assert "| cute mla fp8 | failed: RuntimeError: x |" in md and "**FAILED**" in md
