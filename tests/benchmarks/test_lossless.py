"""benchmarks/lossless.py on the tiny random model: it prints its table with every speculative run's
tokens checked against dense decoding's, and fails loudly when a run's tokens are not dense's."""
from __future__ import annotations

import torch

import benchmarks.lossless as bench


def test_the_table_checks_every_speculative_run(capsys) -> None:
    assert bench.main(["--model", "tiny-random", "--lengths", "150", "--new", "8", "--k", "2", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("CPU ") and "load [" in out
    rows = [line for line in out.splitlines() if line.startswith("| 1")]
    assert [r.split(" | ")[1] for r in rows] == ["dense", "sparse (16)", "speculate K=2", "speculate K=4"]
    assert all(r.endswith("| dense's |") for r in rows if "speculate" in r)


def test_a_run_whose_tokens_are_not_dense_fails(monkeypatch, capsys) -> None:
    real = bench.KvsieveSession.speculative_generate

    def off_by_one(self, ids, new):  # noqa: ANN001, ANN202
        out = real(self, ids, new)
        return type(out)(torch.where(out.tokens == 5, 6, 5), out.acceptance)

    monkeypatch.setattr(bench.KvsieveSession, "speculative_generate", off_by_one)
    assert bench.main(["--model", "tiny-random", "--lengths", "150", "--new", "6", "--k", "2"]) == 1
    assert "MISMATCH: row 0, position" in capsys.readouterr().out
