"""benchmarks/dsa_k_lines.py: the share of 32-token K line groups a selection holds and its runs, on
hand-made selections; the indexer's top positions against a float64 loop over the formula; and the
whole measurement end to end on the tiny random model with random projections."""
from __future__ import annotations

import re

import numpy as np
import torch

from benchmarks.dsa_k_lines import lines_touched, main, runs, top_positions
from kvsieve.selectors.dsa.projections import IndexerProjections, save_projections


def test_lines_and_runs_of_hand_made_selections() -> None:
    assert lines_touched(np.arange(64), 320) == 2 / 10
    assert lines_touched(np.array([0, 31, 32, 300]), 320) == 3 / 10
    assert lines_touched(np.array([5]), 33) == 1 / 2
    assert runs(np.array([1, 2, 3, 7, 9, 10])) == 3
    assert runs(np.array([], dtype=np.int64)) == 0


def test_top_positions_are_the_best_scores() -> None:
    gen = torch.Generator().manual_seed(0)
    q, w, keys = torch.randn(3, 8, generator=gen), torch.rand(3, generator=gen), torch.randn(50, 8, generator=gen)
    score = [sum(float(w[h]) * max(0.0, float(q[h].double() @ keys[p].double())) for h in range(3)) for p in range(50)]
    want = np.sort(np.argsort(-np.array(score), kind="stable")[:7])
    assert np.array_equal(top_positions(q, w, keys, 7), want)
    assert np.array_equal(top_positions(q, w, keys[:5], 7), np.arange(5))


def test_end_to_end_on_the_tiny_model(tmp_path, capsys) -> None:
    torch.manual_seed(0)
    path = tmp_path / "indexer.pt"
    save_projections(str(path), {i: IndexerProjections(64, 2, 16, 8) for i in (0, 1)})
    main(["--projections", str(path), "--model", "tiny-random", "--prompt-tokens", "300", "--rows", "3",
          "--index-topk", "16", "--prompt", "filler", "--save", str(tmp_path / "picked.pt")])
    out = capsys.readouterr().out
    found = re.search(r"filler: K lines touched ([\d.]+) \(by layer and row ([\d.]+)-([\d.]+)\); runs per selection "
                      r"(\d+); a random selection would touch ([\d.]+)", out)
    assert found, out
    mean, lo, hi, n_runs, random = (float(x) for x in found.groups())
    assert 1 / 10 <= lo <= mean <= hi <= 1 and 1 <= n_runs <= 16
    assert abs(random - (1 - (1 - 16 / 300) ** 32)) < 1e-3
    picked = torch.load(tmp_path / "picked.pt")["filler"]  # [layers, rows, topk], sorted, each row's own
    assert picked.dtype == torch.int32 and picked.shape == (2, 3, 16)
    assert (picked.diff(dim=-1) > 0).all() and int(picked.min()) >= 0 and int(picked.max()) < 300
    share = np.mean([len(np.unique(sel.numpy() // 32)) / 10 for sel in picked.reshape(-1, 16)])
    assert abs(share - mean) < 1e-3
