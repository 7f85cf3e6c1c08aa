"""The import rule (docs/architecture.md) holds on this checkout, with no import cycle, and the checker
catches a breach and a cycle."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tools" / "check_layers.py"


def run_check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), str(root)], capture_output=True, text=True, timeout=60)


def test_checkout_follows_the_import_rule():
    res = run_check(ROOT)
    assert res.returncode == 0, res.stdout


def test_checker_reports_upward_imports_and_integrations(tmp_path):
    pkg = tmp_path / "kvsieve"
    for area in ("kernels", "metadata", "sparse/backends", "selectors", "integrations", "eval"):
        (pkg / area).mkdir(parents=True)
        (pkg / area / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "metadata" / "bad.py").write_text("from ..integrations import x\n")
    (pkg / "sparse" / "backends" / "bad.py").write_text("from ...selectors import y\n")
    (pkg / "integrations" / "ok.py").write_text("from ..selectors import z\nfrom ..kernels import w\n")
    (pkg / "eval" / "ok.py").write_text("from ..integrations import v\n")
    (pkg / "integrations" / "bad.py").write_text("import kvsieve.eval.runner\n")
    res = run_check(tmp_path)
    assert res.returncode == 1
    lines = res.stdout.splitlines()
    assert any(ln.startswith("kvsieve/metadata/bad.py:1: metadata imports kvsieve.integrations") for ln in lines)
    assert any("kvsieve/sparse/backends/bad.py:1: a backend imports a selector" in ln for ln in lines)
    assert any(ln.startswith("kvsieve/integrations/bad.py:1: integrations imports kvsieve.eval.runner") for ln in lines)
    assert not any("ok.py" in ln for ln in lines)


def test_checker_fails_on_an_import_cycle_even_through_function_level_imports(tmp_path):
    pkg = tmp_path / "kvsieve"
    (pkg / "eval").mkdir(parents=True)
    for f in (pkg / "__init__.py", pkg / "eval" / "__init__.py"):
        f.write_text("")
    (pkg / "eval" / "a.py").write_text("from .b import g\n")
    (pkg / "eval" / "b.py").write_text("def g():\n    from .c import h\n")
    (pkg / "eval" / "c.py").write_text("from kvsieve.eval import a\n")
    (pkg / "eval" / "d.py").write_text("from .a import x\n")  # imports into the cycle, not part of it
    res = run_check(tmp_path)
    assert res.returncode == 1
    assert res.stdout.splitlines() == ["import cycle among: kvsieve.eval.a, kvsieve.eval.b, kvsieve.eval.c"]
