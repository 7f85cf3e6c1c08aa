"""tools/needle_rank.py on the tiny random model: the needle's tokens are the answer's, the oracle
keeps at least the indexer's mass, and at density 1 both keep everything."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kvsieve.eval.model import ByteTokenizer
from kvsieve.selectors.dsa.projections import IndexerProjections, save_projections

from needle_rank import main, needle_tokens  # tools/ is on sys.path (tests/conftest.py)


def test_needle_tokens_are_the_value():
    text = "<s>haystack. One of the special magic numbers for x is: 1234567. more: 1234567,"
    start = text.index("1234567")
    span = needle_tokens(ByteTokenizer(), text, start, start + 7)
    assert bytes(ByteTokenizer().encode(text)[i] for i in span).decode() == "1234567"
    assert span == list(range(start, start + 7))


def _run(tmp_path: Path, capsys, reduction_factor: int, task: str = "niah_single") -> list[tuple[float, ...]]:
    torch.manual_seed(0)
    path = tmp_path / "idx.pt"
    save_projections(str(path), {i: IndexerProjections(64, 2, 8, 4) for i in (0, 1)})
    assert main(["--model", "tiny-random", "--length", "700", "--projections", str(path), "--depths", "50",
                 "--per-depth", "1", "--samples", "0", "--rows", "4", "--reduction-factor", str(reduction_factor), "--task", task]) == 0
    out = capsys.readouterr().out
    digits = 7 if task == "niah_single" else 5  # the byte tokenizer: one token per digit
    assert re.search(rf"needle tokens \d+\.\.\d+ \({digits}\)", out), out
    rows = re.findall(r"^(\d) \| ([\d.]+) \| ([\d.]+) / ([\d.]+) \| ([\d.]+) / ([\d.]+)$", out, re.M)
    assert [r[0] for r in rows] == ["0", "1"], out
    return [tuple(float(x) for x in r[1:]) for r in rows]


def test_oracle_bounds_the_indexer(tmp_path, capsys):
    for needle, oracle, dsa, n_oracle, n_dsa in _run(tmp_path, capsys, 16):
        assert 0.0 <= needle <= 1.0 and 0.0 <= dsa <= oracle + 1e-6 <= 1.0 + 1e-6
        assert 0.0 <= n_dsa <= 1.0 and 0.0 <= n_oracle <= 1.0


@pytest.mark.parametrize("task", ["niah_single", "passkey"])
def test_density_one_keeps_everything(tmp_path, capsys, task):
    for _, oracle, dsa, n_oracle, n_dsa in _run(tmp_path, capsys, 1, task):
        assert abs(oracle - 1.0) < 1e-3 and abs(dsa - 1.0) < 1e-3 and n_oracle == n_dsa == 1.0
