"""The sweep on a tiny random Llama: output files and their schema, resumption, config handling."""
from __future__ import annotations

import csv
import json
import math
import sys

import pytest
import yaml

from kvsieve.eval import config as cfgmod
from kvsieve.eval.config import SelectorSpec, from_dict, load_config
from kvsieve.eval.model import load_model
from kvsieve.eval.run_plan import plan_runs
from kvsieve.eval.runner import SUMMARY_FIELDS, run_sweep
from kvsieve.eval.store import RUN_FILES


def _raw(out):
    return {
        "model": "tiny-random", "output_dir": str(out), "seed": 0,
        "tasks": {"passkey": {"lengths": [400], "depths": [20, 80], "samples": 1},
                  "fidelity": {"lengths": [160], "samples": 1}},
        "selectors": {"oracle_topk": {"budgets": [8, 32]},
                      "streaming": {"sparsities": [0.9], "params": {"num_sink": 2}}},
    }


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


def test_sweep_outputs_and_resume(tmp_path, tiny, monkeypatch):
    cfg = from_dict(_raw(tmp_path))
    logs = []
    run_sweep(cfg, loaded=tiny, progress=False, log=logs.append)
    folders = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert len(folders) == 2 * (1 + 2 + 1)  # two cells x (dense + 2 oracle + 1 streaming)
    for f in folders:
        assert all((f / name).is_file() for name in RUN_FILES)
        m = json.loads((f / "metrics.json").read_text())
        for key in ("score", "ci95", "n", "achieved_sparsity", "wall_time_s", "budget_tokens", "target_sparsity",
                    "reduction_factor", "attended_fraction_per_layer"):
            assert key in m, (f.name, key)
        # the process's peak since the cell began: at least the model and the cache, within this machine
        if sys.platform == "linux":
            assert 50 < m["peak_rss_mb"] < 64 * 1024, m["peak_rss_mb"]
        if m["task"] == "fidelity":  # one continuous value: no interval
            assert m["n"] == 1 and all(math.isnan(x) for x in m["ci95"])
        else:
            assert m["ci95"][0] <= m["score"] <= m["ci95"][1]
        rows = list(csv.DictReader((f / "predictions.csv").open()))
        assert len(rows) == m["n"]
        assert yaml.safe_load((f / "config.yaml").read_text())["identity"]["task"]["length"] == m["length"]
    dense = json.loads((tmp_path / "passkey__400__tiny-random-llama__dense__full" / "metrics.json").read_text())
    assert dense["achieved_sparsity"] == 0.0 and dense["n"] == 2
    small = json.loads((tmp_path / "passkey__400__tiny-random-llama__oracle_topk__b8" / "metrics.json").read_text())
    assert small["achieved_sparsity"] > 0.8 and small["budget_tokens"] == 8
    stream = json.loads((tmp_path / "passkey__400__tiny-random-llama__streaming__s0.9" / "metrics.json").read_text())
    assert stream["budget_tokens"] == 40 and stream["reduction_factor"] == pytest.approx(10.0)
    fid = json.loads((tmp_path / "fidelity__160__tiny-random-llama__oracle_topk__b32" / "metrics.json").read_text())
    assert 0 < fid["mass_recall"] <= 1 and fid["kl"] >= 0 and fid["topk_overlap"] == pytest.approx(1.0)
    with (tmp_path / "summary.csv").open() as fh:
        summary = list(csv.DictReader(fh))
    assert len(summary) == len(folders) and list(summary[0]) == list(SUMMARY_FIELDS)
    assert (tmp_path / "score_vs_sparsity__passkey.png").is_file()
    assert (tmp_path / "heatmap__passkey.png").is_file()

    # resume: nothing left to do, no task runs
    calls = []
    from kvsieve.eval.tasks import passkey

    monkeypatch.setattr(passkey.PasskeyTask, "run", lambda *a, **k: calls.append(1))
    run_sweep(cfg, loaded=tiny, progress=False, log=logs.append)
    assert calls == []
    # a removed run is redone, and only it
    target = tmp_path / "passkey__400__tiny-random-llama__oracle_topk__b32"
    (target / "metrics.json").unlink()
    monkeypatch.undo()
    before = {f.name: (f / "metrics.json").stat().st_mtime_ns for f in folders if f != target}
    run_sweep(cfg, loaded=tiny, progress=False, log=logs.append)
    assert (target / "metrics.json").is_file()
    assert before == {f.name: (f / "metrics.json").stat().st_mtime_ns for f in folders if f != target}


def test_budget_forms_and_validation():
    s = SelectorSpec(label="q", selector="oracle_topk", sparsities=[0.9, 0.5], params={"block_size": 16})
    b = s.resolve(1000)
    assert [x.tokens for x in b] == [96, 496] and b[0].label == "s0.9"
    assert b[0].sparsity == pytest.approx(0.904) and b[0].reduction_factor == pytest.approx(1000 / 96)
    c = SelectorSpec(label="q", selector="oracle_topk", reduction_factors=[8]).resolve(1024)[0]
    assert c.tokens == 128 and c.label == "x8" and c.sparsity == pytest.approx(0.875)
    cfg = s.sparse_config(b[0])
    assert cfg.params == {"block_size": 16, "budget": 96} and cfg.phases == ("generation",)
    with pytest.raises(ValueError, match="exactly one"):
        SelectorSpec(label="q", selector="x", budgets=[8], sparsities=[0.5])
    with pytest.raises(ValueError, match="sparsities"):
        SelectorSpec(label="q", selector="x", sparsities=[1.5])
    with pytest.raises(ValueError, match="unknown key"):
        from_dict({"modle": "x"})
    with pytest.raises(ValueError, match="reduction_factors entries"):
        SelectorSpec(label="q", selector="x", reduction_factors=[0.5])


@pytest.mark.parametrize("value", [[8], [0.75]])
def test_compression_ratios_is_refused_by_name(tmp_path, value):
    """Either meaning (kvsieve's old L / budget, kvpress's fraction removed) is refused, naming both
    replacements; the raw mapping is left as it was."""
    raw = _raw(tmp_path)
    raw["selectors"]["oracle_topk"] = {"compression_ratios": value}
    before = json.dumps(raw, sort_keys=True)
    with pytest.raises(ValueError, match=r"selectors\.oracle_topk\.compression_ratios: refused.*sparsities.*"
                                         r"reduction_factors"):
        from_dict(raw)
    assert json.dumps(raw, sort_keys=True) == before
    with pytest.raises(ValueError, match="lengths"):
        from_dict({"tasks": {"passkey": {"lengths": []}}})


def test_presets_and_overrides(tmp_path):
    quick = load_config(preset=cfgmod.QUICK, overrides=["tasks.passkey.lengths=[512]", "selectors.streaming=null",
                                                        "output_dir=" + str(tmp_path)])
    assert {t.name: t.lengths for t in quick.tasks}["passkey"] == [512]
    assert "streaming" not in [s.label for s in quick.selectors]
    assert quick.output_dir == str(tmp_path)
    load_config(preset=cfgmod.DEFAULT)
    with pytest.raises(ValueError, match="key.sub=value"):
        load_config(preset=cfgmod.QUICK, overrides=["nonsense"])
    cells = plan_runs(quick, "m")
    assert all(cell[0].label == "dense" for cell in cells)
    assert len({r.folder for cell in cells for r in cell}) == sum(len(c) for c in cells)


ROCKET = {"budgets": [16],  # rocketkv's knob: topk = 4 pages of 4
          "params": {"window_size": 8, "kernel_size": 3, "prompt_budget": 64, "page_size": 4, "summary_dtype": "float32"}}


def test_an_evicting_selector_without_the_context_phase_is_refused_by_name(tmp_path):
    """RocketKV evicts prompt tokens in the context phase; the eval's default phases ([generation])
    would run only its decode-time page selection, so that configuration is refused, naming it."""
    raw = _raw(tmp_path)
    raw["selectors"] = {"rocketkv": dict(ROCKET)}
    with pytest.raises(ValueError, match=r"selectors\.rocketkv\.phases: \['generation'\] leave out the context "
                                         r"phase.*phases: \['context', 'generation'\]"):
        from_dict(raw)


def test_rocketkv_runs_both_of_its_stages_in_the_eval(tmp_path, tiny, monkeypatch):
    from kvsieve.selectors.rocketkv.selector import RocketKVSelector

    calls = {"predict_kv": 0, "predict_attn": 0}
    for name in calls:
        original = getattr(RocketKVSelector, name)

        def spy(self, inputs, _original=original, _name=name):
            calls[_name] += 1
            return _original(self, inputs)

        monkeypatch.setattr(RocketKVSelector, name, spy)
    raw = _raw(tmp_path)
    raw["tasks"] = {"passkey": {"lengths": [400], "depths": [50], "samples": 1}}
    raw["selectors"] = {"rocketkv": {**ROCKET, "phases": ["context", "generation"]}}
    run_sweep(from_dict(raw), loaded=tiny, progress=False, log=lambda _: None)
    assert calls["predict_kv"] > 0 and calls["predict_attn"] > 0  # prompt eviction, then page selection
