"""benchmarks/decode_layer_call.py: the clustered indexer layer's top positions lie in its planted runs,
and the whole measurement on a small cache, each program attending what its budget says."""
from __future__ import annotations

import re

import numpy as np
import torch

from benchmarks.decode_layer_call import BLOCK, Geometry, _layer, main
from kvsieve.kernels.dsa_indexer.naive import score_keys


def test_clustered_keys_hold_most_of_the_selection() -> None:
    g = Geometry(2, 2, 32, 1, 2000)
    gen = torch.Generator().manual_seed(3)
    table = (torch.randperm(16, generator=gen).numpy().astype(np.int32) + 1).reshape(1, 16)
    iq = torch.randn(1, 8, 32, generator=gen).to(torch.bfloat16).float()
    w = torch.rand(8, generator=gen) + 0.1
    for program in ("indexer-clustered", "indexer-random"):
        _, _, prog = _layer(g, program, 1, table, iq, torch.float32, gen)
        keys = torch.stack([prog.index_keys[int(table[0, p // BLOCK]), p % BLOCK] for p in range(g.kv_len)]).float()
        top = score_keys(iq, keys, w[None], None)[0].topk(prog.units).indices
        planted = (keys[top] == iq[0, 0].to(torch.bfloat16).float()).all(1).float().mean().item()
        assert planted >= 0.8 if program == "indexer-clustered" else planted == 0.0, (program, planted)


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
