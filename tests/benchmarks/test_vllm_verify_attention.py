"""benchmarks/vllm_verify_attention.py at CI size (vLLM's environment): both kernels timed per row
count with the ratios present, and a kvsieve kernel whose output differs from vLLM's stops the run."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("vllm.platforms", reason="vLLM is not installed (it runs in its own venv, see .ci/run)")

from benchmarks import vllm_verify_attention as bench  # noqa: E402

ARGS = ["--requests", "2", "--length", "300", "--rows", "1,3", "--heads", "4,2,32", "--block-size", "32",
        "--threads", "1"]


def test_the_benchmark_times_both_kernels_per_row_count(tmp_path, capsys):
    bench.main([*ARGS, "--out", str(tmp_path)])
    (written,) = tmp_path.glob("vllm_verify_attention-*.json")
    results = json.loads(written.read_text())["results"]
    assert [r["rows"] for r in results] == [1, 3]
    for r in results:
        assert r["vllm_ms"] > 0 and r["kvsieve_ms"] > 0
        assert r["vllm_over_kvsieve"] == pytest.approx(r["vllm_ms"] / r["kvsieve_ms"], rel=0.02)
    assert results[0]["vllm_x_one_row"] == 1.0
    assert "| 3 |" in capsys.readouterr().out


def test_a_kernel_that_disagrees_with_vllms_stops_the_run(tmp_path, monkeypatch):
    real = bench.causal_rows_native

    def off_by_a_bit(*a, **kw):  # noqa: ANN002, ANN003
        out, lse = real(*a, **kw)
        return out + 1e-2, lse

    monkeypatch.setattr(bench, "causal_rows_native", off_by_a_bit)
    with pytest.raises(SystemExit, match="R=1: kvsieve's causal rows and vLLM's kernel differ"):
        bench.main([*ARGS, "--out", str(tmp_path)])
    assert not list(tmp_path.glob("*.json"))
    assert torch.get_num_threads() >= 1
