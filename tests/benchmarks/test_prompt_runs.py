"""benchmarks/prompt_runs.py at CI size: the three selections hand-checked, both kernels timed per
selection with the ratio from the unrounded medians, and kernels that disagree stop the run."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from benchmarks import prompt_runs as bench

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler on this machine: the native kernels cannot build")

ARGS = ["--length", "300", "--rows", "40", "--budget", "64", "--sinks", "3", "--heads", "4,2,32", "--block-size", "32",
        "--threads", "1", "--budget-s", "0.05"]


def test_selections_are_what_they_say():
    lens = torch.tensor([100, 300])
    window = bench.selection("window", lens, 64, 3, 32, seed=0)
    assert window[1].tolist() == [0, 1, 2, *range(239, 300)]
    pages = bench.selection("pages", lens, 64, 3, 32, seed=0)
    for n, row in zip(lens.tolist(), pages):
        picked = row[row >= 0]
        blocks = set((picked // 32).tolist())
        assert {0, (n - 1) // 32} <= blocks and len(blocks) == 64 // 32
        assert all(((picked // 32) == b).sum() == min(32, n - 32 * b) for b in blocks)  # whole blocks
    tokens = bench.selection("tokens", lens, 64, 3, 32, seed=0)
    for n, row in zip(lens.tolist(), tokens):
        picked = row[row >= 0]
        assert picked.numel() == 64 and picked.unique().numel() == 64 and int(picked.max()) < n


def test_the_benchmark_times_both_kernels_per_selection(tmp_path, capsys):
    bench.main([*ARGS, "--out", str(tmp_path)])
    (written,) = tmp_path.glob("prompt_runs-*.json")
    results = json.loads(written.read_text())["results"]
    assert [r["selection"] for r in results] == list(bench.SELECTIONS)
    for r in results:
        assert r["tiled_ms"] > 0 and r["per_row_ms"] > 0 and r["selected_per_row"] > 0
        assert r["per_row_over_tiled"] == pytest.approx(r["per_row_ms"] / r["tiled_ms"], rel=1e-3)
    assert "| window |" in capsys.readouterr().out


def test_kernels_that_disagree_stop_the_run(tmp_path, monkeypatch):
    real = bench.prompt_runs_native

    def off_by_a_bit(*a, **kw):  # noqa: ANN002, ANN003
        out, lse = real(*a, **kw)
        return out + 1e-2, lse

    monkeypatch.setattr(bench, "prompt_runs_native", off_by_a_bit)
    with pytest.raises(SystemExit, match="window: the tiled prompt kernel and the decode kernel differ"):
        bench.main([*ARGS, "--out", str(tmp_path)])
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.parametrize("bad,message", [
    (["--rows", "301"], r"--rows 301: the request's last rows, 1 to --length \(300\)"),
    (["--budget", "48"], r"--budget 48: the pages selection takes whole blocks of --block-size 32, at least two"),
    (["--budget", "32"], r"--budget 32: the pages selection takes whole blocks"),
    (["--heads", "3,2,32"], r"--heads \[3, 2, 32\]: Hq must be a multiple of Hkv"),
    (["--selections", "window,stripes"], r"--selections: unknown \['stripes'\]"),
])
def test_options_it_cannot_honour_are_refused_by_name(tmp_path, bad, message):
    with pytest.raises(SystemExit, match=message):
        bench.main([*ARGS, *bad, "--out", str(tmp_path)])
    assert not list(tmp_path.glob("*.json"))
