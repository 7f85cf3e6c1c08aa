"""AOT compilation of the DSA Triton kernels for sm_90a and sm_100a (no GPU), in a child process
(TRITON_INTERPRET must be unset there): no spills, shared memory within the limit, and the
indexer's 64 heads reach the tensor-core MMA of each arch."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def rows():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "kvsieve.kernels.aot.dsa_report", "--json"], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        pytest.fail(f"AOT report failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_no_spills_and_smem_within_limit(rows):
    assert len(rows) == 10
    for r in rows:
        assert r["registers"] > 0, r
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert r["shared"] <= r["smem_limit"], r


def test_indexer_uses_tensor_core_mma(rows):
    for r in rows:
        if r["kernel"].startswith("dsa_indexer"):
            assert r["mma"] == {"sm_90a": "wgmma", "sm_100a": "tcgen05"}[r["arch"]], r
