"""Fidelity scores the layers the selector ran on, and says each layer's recall."""
from __future__ import annotations

import json

import pytest

from kvsieve.eval.config import from_dict
from kvsieve.eval.model import load_model
from kvsieve.eval.runner import run_sweep


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")  # 2 layers


def _metrics(out, tiny, dense_layers):
    raw = {"model": "tiny-random", "output_dir": str(out), "seed": 0,
           "tasks": {"fidelity": {"lengths": [160], "samples": 2}},
           "selectors": {"oracle_topk": {"budgets": [4], "dense_layers": dense_layers}}}
    run_sweep(from_dict(raw), loaded=tiny, progress=False, log=lambda _: None)
    return json.loads((out / "fidelity__160__tiny-random-llama__oracle_topk__b4" / "metrics.json").read_text())


def test_score_is_the_mean_over_selected_layers(tmp_path, tiny):
    both = _metrics(tmp_path / "both", tiny, [])
    one = _metrics(tmp_path / "one", tiny, [0])
    assert len(both["mass_recall_per_layer"]) == len(one["mass_recall_per_layer"]) == 2
    assert all(r < 0.999 for r in both["mass_recall_per_layer"])  # budget 4 of 152: recall really drops
    # the dense layer reads everything (recall 1) and is left out of the score, which is layer 1's recall
    assert one["mass_recall_per_layer"][0] == 1.0
    assert one["score"] == pytest.approx(one["mass_recall_per_layer"][1], abs=1e-4)
    assert one["score"] < 0.999
    # with both layers selected the score is the mean of both (samples and steps weigh alike)
    assert both["score"] == pytest.approx(sum(both["mass_recall_per_layer"]) / 2, abs=1e-4)


def test_dense_run_scores_one_on_every_layer(tmp_path, tiny):
    raw = {"model": "tiny-random", "output_dir": str(tmp_path), "seed": 0,
           "tasks": {"fidelity": {"lengths": [160], "samples": 1}}, "selectors": {}}
    run_sweep(from_dict(raw), loaded=tiny, progress=False, log=lambda _: None)
    m = json.loads((tmp_path / "fidelity__160__tiny-random-llama__dense__full" / "metrics.json").read_text())
    assert m["score"] == 1.0 and m["mass_recall_per_layer"] == [1.0, 1.0]
