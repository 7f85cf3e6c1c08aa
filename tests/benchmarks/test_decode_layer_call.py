"""benchmarks/decode_layer_call.py: the clustered indexer layer's top positions lie in its planted runs,
the recorded one's are exactly its selection, and the whole measurement on a small cache, each program
attending what its budget says."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from benchmarks.decode_layer_call import BLOCK, Geometry, _layer, main
from kvsieve.kernels.dsa_indexer.naive import score_keys


G2K = Geometry(2, 2, 32, 1, 2000)


def _setup(rows: int, seed: int) -> tuple[torch.Generator, np.ndarray, torch.Tensor, torch.Tensor]:
    """A generator, a shuffled table of ``rows`` rows, bf16-valued index queries and weights."""
    gen = torch.Generator().manual_seed(seed)
    table = (torch.randperm(16 * rows, generator=gen).numpy().astype(np.int32) + 1).reshape(rows, 16)
    return gen, table, torch.randn(rows, 8, 32, generator=gen).to(torch.bfloat16).float(), torch.rand(8, generator=gen) + 0.1


def _top(prog, table: np.ndarray, iq: torch.Tensor, w: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ``r``'s index keys ``[kv_len, 32]`` and its ``prog.units`` best positions by the plain formula."""
    keys = torch.stack([prog.index_keys[int(table[r, p // BLOCK]), p % BLOCK] for p in range(G2K.kv_len)]).float()
    return keys, score_keys(iq[r:r + 1], keys, w[None], None)[0].topk(prog.units).indices


def test_clustered_keys_hold_most_of_the_selection() -> None:
    gen, table, iq, w = _setup(1, 3)
    for program in ("indexer-clustered", "indexer-random"):
        _, _, prog = _layer(G2K, program, 1, table, iq, torch.float32, gen)
        keys, top = _top(prog, table, iq, w, 0)
        planted = (keys[top] == iq[0, 0].to(torch.bfloat16).float()).all(1).float().mean().item()
        assert planted >= 0.8 if program == "indexer-clustered" else planted == 0.0, (program, planted)


def test_recorded_keys_give_the_recorded_selection() -> None:
    gen, table, iq, w = _setup(2, 4)
    recorded = torch.stack([torch.randperm(2000, generator=gen)[:125].sort().values for _ in range(2)])
    _, _, prog = _layer(G2K, "indexer-recorded", 2, table, iq, torch.float32, gen, recorded)
    assert prog.units == 125
    for r in range(2):
        assert torch.equal(_top(prog, table, iq, w, r)[1].sort().values, recorded[r])
    with pytest.raises(ValueError, match="recorded selections' budget"):
        _layer(G2K, "indexer-recorded", 2, table, iq, torch.float32, gen, recorded, budget=16)


def test_small_run_attends_each_budget(capsys) -> None:
    main(["--geometry", "smollm2", "--kv-len", "600", "--layers", "2", "--rows", "1,2", "--reps", "2"])
    out = capsys.readouterr().out
    assert re.search(r"^CPU .*; threads 1; load average [\d.]+$", out, re.M), out
    found = re.findall(r"^  (\S+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)  \[(.*)\]$", out, re.M)
    assert [(p, int(r)) for p, r, *_ in found] == [(p, r) for p in ("indexer-random", "indexer-clustered",
                                                                    "streaming", "pages") for r in (1, 2)]
    for program, _, median, low, attended in found:
        counts = [int(x) for x in attended.split(",")]
        assert len(counts) == 3 and 0 < float(low) <= float(median)
        if program == "pages":  # one 128-token page of the five (the newest, 88 tokens, forced)
            assert all(0 < c <= BLOCK for c in counts)
        else:
            assert counts == [600 // 16] * 3


def test_budget_sets_the_positions_each_head_attends(capsys) -> None:
    main(["--kv-len", "600", "--layers", "1", "--rows", "2", "--reps", "1", "--budget", "16",
          "--programs", "indexer-random,indexer-clustered,streaming"])
    out = capsys.readouterr().out
    assert "600 tokens, bfloat16, budget 16" in out
    found = re.findall(r"^  (\S+)\s+2\s+[\d.]+\s+[\d.]+  \[(.*)\]$", out, re.M)
    assert found == [(p, "16, 16, 16") for p in ("indexer-random", "indexer-clustered", "streaming")]
    for bad in (["--budget", "0"], ["--budget", "601"], ["--budget", "16", "--programs", "pages"]):
        with pytest.raises(SystemExit):
            main(["--kv-len", "600", *bad])
    # whole pages: two of five full 128-token pages
    main(["--kv-len", "640", "--layers", "1", "--rows", "1", "--reps", "1", "--budget", "256", "--programs", "pages"])
    assert re.search(r"^  pages\s+1\s+[\d.]+\s+[\d.]+  \[256, 256, 256\]$", capsys.readouterr().out, re.M)


def test_small_run_of_recorded_selections(tmp_path, capsys) -> None:
    gen = torch.Generator().manual_seed(6)
    picked = torch.stack([torch.stack([torch.randperm(600, generator=gen)[:40].sort().values for _ in range(2)])
                          for _ in range(2)]).to(torch.int32)  # [layers, rows, 40]
    torch.save({"essay": picked}, tmp_path / "picked.pt")
    argv = ["--kv-len", "600", "--layers", "3", "--rows", "1,3", "--reps", "2", "--selections", str(tmp_path / "picked.pt")]
    main([*argv, "--selection-prompt", "essay", "--programs", "indexer-recorded"])
    found = re.findall(r"^  indexer-recorded\s+(\d+)\s+[\d.]+\s+[\d.]+  \[(.*)\]$", capsys.readouterr().out, re.M)
    assert [(int(r), a) for r, a in found] == [(1, "40, 40, 40"), (3, "40, 40, 40")]
    with pytest.raises(SystemExit):
        main([*argv, "--programs", "indexer-recorded"])  # no "filler" selections in the file
    with pytest.raises(SystemExit):
        main([*argv, "--selection-prompt", "essay", "--programs", "indexer-recorded", "--budget", "8"])  # its own budget
    with pytest.raises(SystemExit):
        main(["--kv-len", "600", "--programs", "indexer-recorded"])  # no file
    with pytest.raises(SystemExit):
        main(["--kv-len", "600", "--programs", "streaming", "--selection-prompt", "essay"])  # a prompt of no file
    with pytest.raises(SystemExit):
        main([*argv, "--selection-prompt", "essay", "--programs", "streaming"])  # selections nothing reads
    negative = picked.clone()
    negative[0, 0, 0] = -1
    torch.save({"essay": negative}, tmp_path / "negative.pt")
    with pytest.raises(SystemExit):
        main(["--kv-len", "600", "--selections", str(tmp_path / "negative.pt"), "--selection-prompt", "essay"])
    with pytest.raises(SystemExit):
        main([*argv[:-2], "--selections", str(tmp_path / "picked.pt"), "--kv-len", "500", "--selection-prompt", "essay"])
