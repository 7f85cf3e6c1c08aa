"""The GPU verification driver: steps, per-step time budgets, the JSON + Markdown report.

Each step runs in a child process (``python -m ...``) with ``timeout = min(budget, time left)``,
so one hung kernel cannot eat the whole lease; the budgets add up to less than the 8-minute
total (``TOTAL_BUDGET_S``). A step's status is ``pass``, ``fail`` (non-zero exit, a mismatch),
``timeout`` or ``skipped`` (with the reason: dry run, no GPU, tool or bundle missing). The run
exits 1 when any step failed or timed out, 0 otherwise; without a GPU and without
``--dry-run`` it refuses (exit 2) instead of reporting GPU steps as skipped.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .report import render_markdown

__all__ = ["Step", "StepResult", "STEPS", "TOTAL_BUDGET_S", "run", "main"]

ROOT = Path(__file__).resolve().parents[2]
TOTAL_BUDGET_S = 470.0  # under the 8 minutes asked for, with room for start-up and the report
IMPORTS = ("kvsieve", "kvsieve.kernels.sparse_gqa_decode.triton", "kvsieve.kernels.sparse_mla_decode.triton",
           "kvsieve.kernels.paged_prefill.triton", "kvsieve.kernels.compact_kv.triton", "kvsieve.kernels.topk.triton",
           "kvsieve.kernels.dsa_indexer.triton", "kvsieve.kernels.topk.cute.host", "kvsieve.kernels.decode_layer.device", "kvsieve.metadata",
           "kvsieve.sparse", "kvsieve.selectors")


@dataclass(frozen=True)
class Step:
    """One step: a child-process command, its budget, whether it needs the GPU."""

    name: str
    what: str
    budget_s: float
    needs_gpu: bool


@dataclass
class StepResult:
    name: str
    what: str
    status: str  # pass | fail | timeout | skipped
    seconds: float
    budget_s: float
    reason: str = ""
    command: list[str] = field(default_factory=list)
    output_tail: str = ""
    details: object = None


STEPS = (
    Step("imports", "import every kvsieve layer with the installed torch/triton", 30, False),
    Step("triton_cases", "Triton kernels vs their references on awkward shapes", 75, False),
    Step("gpu_tests", "pytest -m 'sm90 or sm100' tests/kernels tests/cute", 110, True),
    Step("benchmarks", "Triton kernel GB/s vs HBM peak, TFLOP/s vs bf16 matmul", 70, True),
    Step("sanitizer", "compute-sanitizer memcheck on one small case per kernel", 110, True),
    Step("cute_aot", "CuTe-DSL kernels from the ahead-of-time bundle", 45, False),
    Step("cute_benchmarks", "CuTe MLA decode (bundle) GB/s and TFLOP/s beside the Triton kernel", 30, True),
)


def _gpu() -> tuple[bool, str]:
    try:
        import torch
    except Exception as e:  # pragma: no cover - the image always has torch
        return False, f"torch not importable: {e}"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    return True, f"{torch.cuda.get_device_name(0)} (SM {''.join(map(str, torch.cuda.get_device_capability(0)))})"


def environment() -> dict:
    """Versions and tools; every value read here, none assumed."""
    env: dict[str, object] = {"python": platform.python_version(), "machine": platform.machine()}
    for mod in ("torch", "triton", "transformers", "numpy"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as e:
            env[mod] = f"missing ({type(e).__name__})"
    try:
        import cutlass  # noqa: F401
        env["cutlass_dsl"] = "importable"
    except Exception:
        env["cutlass_dsl"] = "missing"
    ok, dev = _gpu()
    env["gpu"] = dev
    for tool in ("nvcc", "ncu", "compute-sanitizer", "gcc"):
        env[tool] = shutil.which(tool) or "missing"
    return env


def _commands(step: str, out: Path, dry_run: bool, perturb: float, cute_bundle: Path) -> list[str] | None:
    py = sys.executable
    if step == "imports":
        code = "import importlib; [importlib.import_module(m) for m in %r]; print('imported', %d)" % (
            IMPORTS, len(IMPORTS))
        return [py, "-c", code]
    if step == "triton_cases":
        dev = ["--device", "cpu", "--small"] if dry_run else ["--device", "cuda"]
        return [py, "-m", "kvsieve.gpu_check.cases", *dev, "--perturb", str(perturb),
                "--json", str(out / "cases.json")]
    if step == "gpu_tests":
        return [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "sm90 or sm100",
                "tests/kernels", "tests/cute", f"--junitxml={out / 'gpu_tests.xml'}"]
    if step == "benchmarks":
        return [py, "-m", "benchmarks.triton_kernels", "--quick", "--json", str(out / "benchmarks.json")]
    if step == "sanitizer":
        tool = shutil.which("compute-sanitizer")
        if tool is None:
            return None
        return [tool, "--tool", "memcheck", "--error-exitcode", "86", "--print-limit", "20", py, "-m",
                "kvsieve.gpu_check.cases", "--device", "cuda", "--small", "--json", str(out / "sanitizer_cases.json")]
    if step == "cute_benchmarks":
        return [py, "-m", "benchmarks.cute_kernels", "--json", str(out / "cute_benchmarks.json")]
    if step == "cute_aot":
        action = ["check"] if dry_run else ["run"]
        return [py, "-m", "kvsieve.gpu_check.cute_aot", *action, "--bundle", str(cute_bundle),
                "--json", str(out / "cute_aot.json")]
    raise ValueError(f"step: unknown {step!r}")


def _child_env(step: str, out: Path, dry_run: bool, cute_bundle: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TRITON_CACHE_DIR", str(out / "triton_cache"))  # compiled once, reused by later steps
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("TRITON_INTERPRET", None)
    if dry_run and step == "triton_cases":
        env["TRITON_INTERPRET"] = "1"
    if step == "cute_benchmarks":
        env["KVSIEVE_CUTE_AOT"] = str(cute_bundle)
    if step == "sanitizer":  # the caching allocator would hide out-of-bounds accesses inside its pool
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    return env


def _details(step: str, out: Path) -> object:
    name = {"triton_cases": "cases.json", "benchmarks": "benchmarks.json", "cute_aot": "cute_aot.json",
            "sanitizer": "sanitizer_cases.json", "cute_benchmarks": "cute_benchmarks.json"}.get(step)
    if step == "gpu_tests" and (out / "gpu_tests.xml").exists():
        import xml.etree.ElementTree as ET
        suite = ET.parse(out / "gpu_tests.xml").getroot()
        suite = suite[0] if suite.tag == "testsuites" else suite
        return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    if name and (out / name).exists():
        return json.loads((out / name).read_text())
    return None


def _run_bounded(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[str, int | None]:
    """Run ``cmd`` in its own process group; on timeout the whole group is killed (a test's own
    child process must not keep the GPU busy during the next step). Returns (output, exit code or
    None on timeout)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
        return text, proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        return text, None


def run_step(step: Step, out: Path, *, dry_run: bool, gpu_ok: bool, time_left: float, perturb: float,
             cute_bundle: Path) -> StepResult:
    """Run one step (or say why it was skipped)."""
    res = StepResult(step.name, step.what, "skipped", 0.0, step.budget_s)
    if step.needs_gpu and (dry_run or not gpu_ok):
        res.reason = "dry run: needs a GPU" if dry_run else "no CUDA device"
        return res
    if step.name == "cute_benchmarks" and not (cute_bundle / "manifest.json").exists():
        res.reason = f"no CuTe AOT bundle at {cute_bundle}"
        return res
    cmd = _commands(step.name, out, dry_run, perturb, cute_bundle)
    if cmd is None:
        res.reason = "compute-sanitizer not on PATH"
        return res
    timeout = min(step.budget_s, time_left)
    if timeout < 5:
        res.status, res.reason = "timeout", f"no time left in the {TOTAL_BUDGET_S:.0f} s total"
        return res
    res.command = cmd
    t0 = time.perf_counter()
    text, code = _run_bounded(cmd, _child_env(step.name, out, dry_run, cute_bundle), timeout)
    res.seconds = round(time.perf_counter() - t0, 2)
    res.output_tail = text[-3000:]
    if code is None:
        res.status, res.reason = "timeout", f"over its {timeout:.0f} s budget"
    elif code == 0:
        res.status = "pass"
    elif step.name == "sanitizer" and "Device not supported" in text:  # gVisor machines refuse the tool
        res.status, res.reason = "skipped", "compute-sanitizer: 'Device not supported' on this machine's runtime"
    elif step.name == "cute_aot" and code == 3:  # the bundle is absent: nothing to verify with
        res.status, res.reason = "skipped", text.strip().splitlines()[-1] if text.strip() else "no bundle"
    else:
        res.status, res.reason = "fail", f"exit {code}"
    res.details = _details(step.name, out)
    return res


def run(out: Path, *, dry_run: bool, perturb: float = 0.0, steps: tuple[str, ...] | None = None,
        cute_bundle: Path | None = None) -> dict:
    """Run the steps, write ``gpu_check.json`` and ``gpu_check.md`` under ``out``; the report dict."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    gpu_ok, _ = _gpu()
    bundle = cute_bundle or ROOT / ".cute_aot" / "sm90"
    results = []
    for step in STEPS:
        if steps is not None and step.name not in steps:
            continue
        left = TOTAL_BUDGET_S - (time.perf_counter() - t0)
        r = run_step(step, out, dry_run=dry_run, gpu_ok=gpu_ok, time_left=left, perturb=perturb, cute_bundle=bundle)
        print(f"[gpu_check] {r.name:<13} {r.status:<8} {r.seconds:6.1f}s / {r.budget_s:.0f}s  {r.reason}", flush=True)
        results.append(r)
    env = environment()
    report = {
        "meta": {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "dry_run": dry_run,
                 "perturb": perturb, "total_budget_s": TOTAL_BUDGET_S,
                 "wall_s": round(time.perf_counter() - t0, 2), "environment": env},
        "steps": [asdict(r) for r in results],
        "ok": all(r.status in ("pass", "skipped") for r in results),
    }
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(render_markdown(report))
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvsieve.gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out", help="report folder")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: run the CPU parts, report GPU steps skipped")
    ap.add_argument("--steps", default=None, help="comma-separated subset of: " + ",".join(s.name for s in STEPS))
    ap.add_argument("--cute-bundle", default=None, help="CuTe AOT bundle folder (default .cute_aot/sm90)")
    ap.add_argument("--perturb", type=float, default=0.0,
                    help="self-test only: scale the references by 1+EPS so the cases must fail")
    a = ap.parse_args(argv)
    if not a.dry_run and not _gpu()[0]:
        print("gpu_check: no CUDA device here; run with --dry-run to exercise the CPU parts", file=sys.stderr)
        return 2
    steps = tuple(a.steps.split(",")) if a.steps else None
    if steps:
        unknown = set(steps) - {s.name for s in STEPS}
        if unknown:
            ap.error(f"--steps: unknown {sorted(unknown)}")
    report = run(Path(a.out), dry_run=a.dry_run, perturb=a.perturb, steps=steps,
                 cute_bundle=Path(a.cute_bundle) if a.cute_bundle else None)
    print(f"[gpu_check] {'OK' if report['ok'] else 'FAILED'} in {report['meta']['wall_s']} s; "
          f"report: {Path(a.out) / 'gpu_check.md'}")
    return 0 if report["ok"] else 1
