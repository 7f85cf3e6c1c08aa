"""The ``ruler`` preset: planned (not run: it is a many-hour CPU run), and its CI-sized twin on the
tiny random model, which runs every RULER task and the continuation measure through the sweep and
checks that each prediction's score is the task's scorer applied to it."""
from __future__ import annotations

import csv

import pytest

from kvsieve.eval.config import RULER, load_config
from kvsieve.eval.run_plan import plan_runs
from kvsieve.eval.runner import run_sweep
from kvsieve.eval.tasks import Sample, get_task

FAMILIES = {"niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
            "niah_multikey_3", "niah_multivalue", "niah_multiquery", "variable_tracking", "cwe", "fwe",
            "essay_continuation"}
SERVABLE = {"oracle_topk", "streaming", "quest", "block_select", "dsa"}  # the served preset's selectors


def test_ruler_preset_plans_every_family_selector_and_density_at_n_20():
    cfg = load_config(preset=RULER)
    assert cfg.model == "gemma3-270m" and cfg.engine == "vllm"
    assert {t.name for t in cfg.tasks} == FAMILIES
    for t in cfg.tasks:
        assert t.lengths == [8192, 16384]
        assert t.samples * (len(t.depths) if get_task(t.name).uses_depths else 1) >= 20, t.name
    assert {s.selector for s in cfg.selectors} == SERVABLE
    for s in cfg.selectors:
        for length in (8192, 16384):
            assert [b.tokens / length for b in s.resolve(length)] == pytest.approx([1 / 4, 1 / 16, 1 / 64])
    cells = plan_runs(cfg, "gemma-3-270m")
    # per cell: dense, 5 selectors x 3 densities, and each selector's dense run through the plug-in
    assert len(cells) == 12 * 2 and all(len(c) == 1 + 5 * 3 + 5 for c in cells)
    assert len({r.folder for c in cells for r in c}) == 504


def test_ruler_twin_on_the_tiny_model_scores_every_task(tmp_path):
    """Every family at 2,000 tokens, one prompt, dense and the ceiling (oracle_topk) at the three densities."""
    tasks = [f"tasks.{name}={{lengths: [2000], depths: [40], samples: 1}}" for name in sorted(FAMILIES)]
    others = [f"selectors.{s}=null" for s in sorted(SERVABLE - {"oracle_topk"})]
    cfg = load_config(preset=RULER, overrides=["model=tiny-random", "engine=transformers", f"output_dir={tmp_path}",
                                               *others, *tasks])
    result = run_sweep(cfg, progress=False, log=lambda _: None)
    assert result.failed == 0 and len(result.rows) == 12 * (1 + 3)
    for row in result.rows:
        task = get_task(row["task"])
        with open(tmp_path / row["folder"] / "predictions.csv", newline="", encoding="utf-8") as f:
            (pred,) = list(csv.DictReader(f))
        if row["task"] == "essay_continuation":  # scored against the dense run's tokens
            matched = int(pred["matched_tokens"])
            assert float(pred["score"]) == matched / task.max_new_tokens
            assert matched == task.max_new_tokens if row["selector"] == "dense" else 0 <= matched <= 32
            continue
        sample = Sample(0, "", pred["answers"].split("|"))
        assert float(pred["score"]) == task.score(pred["prediction"], sample), row["folder"]
