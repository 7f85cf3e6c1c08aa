"""AOT compile every kernel at its shipped sm_90a / sm_100a config (no GPU needed).

Runs ``python -m kvsieve.kernels.aot.triton_report --json`` in a subprocess without
TRITON_INTERPRET (this test session runs the interpreter) and a fresh TRITON_CACHE_DIR;
the report reads registers/spills from Triton's ptxas log and shared memory from metadata."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

EXPECTED_MMA = {("paged_prefill dense", "sm_90a"): "wgmma",
                ("paged_prefill dense", "sm_100a"): "tcgen05",
                ("sparse_mla_decode (split-K)", "sm_100a"): "tcgen05",
                ("sparse_mla_decode (split-K)", "sm_90a"): "mma.sync",
                ("sparse_gqa_decode", "sm_90a"): "mma.sync"}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-m", "kvsieve.kernels.aot.triton_report", "--json"],
                         env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_every_kernel_compiled_for_both_archs(rows):
    assert {r["arch"] for r in rows} == {"sm_90a", "sm_100a"}
    assert len(rows) == 12


def test_no_spills_and_smem_within_limit(rows):
    for r in rows:
        assert r["registers"] > 0, r
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert r["shared"] <= r["smem_limit"], r


def test_mma_families(rows):
    got = {(r["kernel"], r["arch"]): r["mma"] for r in rows}
    for key, fam in EXPECTED_MMA.items():
        assert got[key] == fam, (key, got[key])
