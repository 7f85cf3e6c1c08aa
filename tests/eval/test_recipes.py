"""The ``recipes`` preset (every selector at its published recipe) and the model-specific
calibration of its dsa (distilled indexer) and skip_softmax (calibrated factors) entries: cached by
model hash and reused, with the sweep saying which."""
from __future__ import annotations

import copy
import json
from importlib import resources

import pytest
import yaml

from kvsieve.eval import calibration
from kvsieve.eval.config import RECIPES, ConfigError, from_dict, load_config
from kvsieve.eval.model import load_model
from kvsieve.eval.run_plan import plan_runs, run_identity
from kvsieve.eval.runner import run_sweep
from kvsieve.integrations.transformers import KvsieveSession
from kvsieve.selectors.dsa.projections import load_projections
from kvsieve.selectors.skip_softmax.selector import interpolate_factor

# the preset's dsa distillation shrunk for the tiny model; one retrieval window keeps that path in:
# one fact (its question-and-answer tail: 80 byte tokens, every one of them a sampled row) in 512 tokens
TINY_DSA = {"seq_len": 512, "num_seqs": 2, "heldout_seqs": 1, "rows": 96, "retrieval_seqs": 1, "retrieval_facts": 1,
            "epochs": 1}
TINY = ["model=tiny-random", f"selectors.dsa.calibrate_params={json.dumps(TINY_DSA)}",
        # the tiny random model's attention is nearly flat: tiles start to be skipped near factor = kv_len,
        # and at 512 tokens (8 tiles of 64) at most 7 of 8 are skipped
        "selectors.skip_softmax.calibrate_params={length: 512, num_texts: 1, factors: [490, 500, 520, 560, 1000]}",
        "selectors.skip_softmax.sparsities=[0.5, 0.75]"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(calibration, "calibration_dir", lambda: tmp_path / "prepared")
    return tmp_path / "prepared"


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


def test_preset_names_every_selector_cites_its_sources_and_spans_the_densities():
    cfg = load_config(preset=RECIPES)
    assert {s.selector for s in cfg.selectors} == {"oracle_topk", "streaming", "quest", "rocketkv", "dsa",
                                                   "block_select", "snapkv", "skip_softmax"}
    text = resources.files("kvsieve.eval").joinpath("configs", "recipes.yaml").read_text(encoding="utf-8")
    for source in ("arXiv 2406.10774", "arXiv 2502.14051", "arXiv 2404.14469", "arXiv 2309.17453",
                   "arXiv 2512.12087", "DeepSeek-V3.2", "kvpress", "minimax_m3"):
        assert source in text, source
    spec = {s.label: s for s in cfg.selectors}
    assert spec["quest"].dense_layers == [0, 1] and spec["quest"].params["page_size"] == 16
    assert spec["streaming"].params == {"num_sink": 4}
    assert spec["dsa"].calibrate == "distill_indexer" and spec["skip_softmax"].calibrate == "calibrate_skip_softmax"
    for task in cfg.tasks:
        for length in task.lengths:
            densities = {s.label: [b.tokens / length for b in s.resolve(length)] for s in cfg.selectors}
            # skip_softmax cannot skip the tile holding a row's max: 1/64 is out of reach at 2K
            assert densities.pop("skip_softmax") == pytest.approx([1 / 2, 1 / 4, 1 / 16])
            assert max(max(d) for d in densities.values()) == pytest.approx(1 / 4)
            assert min(min(d) for d in densities.values()) == pytest.approx(1 / 64)
            full = [d for d in densities.values() if len(d) == 3]
            assert len(full) >= 7 and all(d == pytest.approx([1 / 4, 1 / 16, 1 / 64]) for d in full)


def test_calibrated_for_tiny_random_then_reused_and_every_run_lowers(cache, tiny):
    cfg = load_config(preset=RECIPES, overrides=TINY)
    logs: list[str] = []
    first = calibration.calibrate_selectors(cfg, tiny, logs.append)
    assert len(logs) == 2
    assert "dsa: trained a DSA indexer for tiny-random-llama" in logs[0] and str(cache) in logs[0]
    assert "skip_softmax: calibrated skip-softmax for tiny-random-llama" in logs[1]
    spec = {s.label: s for s in first.selectors}
    layers, meta = load_projections(spec["dsa"].params["projections"])
    assert sorted(layers) == [0, 1] and meta["epochs"] == 1
    points = spec["skip_softmax"].params["calibration_points"]["generation"]
    factors = [interpolate_factor(points, t) for t in (0.5, 0.75)]
    assert 490 < factors[0] < factors[1] < 560  # more skipping needs a larger factor
    assert "factor per target sparsity: 0.5 -> " in logs[1]
    logs.clear()
    again = calibration.calibrate_selectors(cfg, tiny, logs.append)
    assert logs[0].startswith("kvsieve eval: dsa: reused the DSA indexer distilled for tiny-random-llama")
    assert logs[1].startswith("kvsieve eval: skip_softmax: reused the skip-softmax calibration of tiny-random-llama")
    assert spec["dsa"].params["projections"] in logs[0]
    assert again.selectors == first.selectors
    runs = [r for cell in plan_runs(first, tiny.name) for r in cell]
    again_runs = [r for cell in plan_runs(again, tiny.name) for r in cell]
    assert [run_identity(first, r) for r in runs] == [run_identity(again, r) for r in again_runs]
    # the identity keeps the entry fields' first names, so runs recorded before the rename keep their ids
    dsa_identity = next(run_identity(first, r)["selector"] for r in runs if r.selector and r.selector.label == "dsa")
    assert dsa_identity["prepare"] == "distill_indexer" and "calibrate" not in dsa_identity
    assert dsa_identity["prepare_params"] == spec["dsa"].calibrate_params
    with KvsieveSession(tiny.model, None, max_tokens=4096 + 256) as session:
        for run in runs:
            session.set_config(run.sparse)  # lower_config with the model's layers, support checks
    assert {r.sparse.selector for r in runs if r.sparse} == {s.selector for s in first.selectors}


@pytest.mark.parametrize("entry,message", [
    ({"selector": "dsa", "budgets": [8], "calibrate": "train"}, r"selectors\.x\.calibrate: unknown step 'train'"),
    ({"selector": "quest", "budgets": [16], "calibrate": "distill_indexer"},
     r"'distill_indexer' calibrates selector 'dsa', not 'quest'"),
    ({"selector": "dsa", "budgets": [8], "calibrate": "distill_indexer", "calibrate_params": {"epoch": 1}},
     r"unknown option\(s\) \['epoch'\]"),
    ({"selector": "dsa", "budgets": [8], "calibrate_params": {"epochs": 1}},
     r"calibrate_params: given without calibrate"),
    ({"selector": "dsa", "budgets": [8], "prepare": "distill_indexer"},
     r"selectors\.x\.prepare: refused: the key is now calibrate:"),
    ({"selector": "dsa", "budgets": [8], "calibrate": "distill_indexer", "prepare_params": {"epochs": 1}},
     r"selectors\.x\.prepare_params: refused: the key is now calibrate_params:"),
])
def test_bad_calibration_is_refused_by_name(entry, message):
    raw = {"model": "tiny-random", "tasks": {"passkey": {"lengths": [200]}}, "selectors": {"x": entry}}
    before = copy.deepcopy(raw)
    with pytest.raises(ConfigError, match=message):
        from_dict(raw)
    assert raw == before


@pytest.mark.parametrize("override", ["selectors.dsa.prepare=null", "selectors.dsa.prepare_params=null",
                                      "selectors.skip_softmax.prepare_params={length: 512}"])
def test_the_former_keys_are_refused_in_overrides_too(override):
    """``--set selectors.dsa.prepare=null`` once removed the step; it must not pass silently now."""
    with pytest.raises(ConfigError, match=r"selectors\.\w+\.prepare(_params)?: refused: the key is now calibrate"):
        load_config(preset=RECIPES, overrides=[override])


def test_windows_longer_than_the_corpus_holds_are_refused_by_name_and_caches_nothing(cache, tiny, monkeypatch):
    """Windows the corpus cannot fill (more retrieval windows than the essays hold are cut from
    further passes, but no pass fills a window longer than the corpus): the refusal names the
    entry, the step, the model and the shortfall, and comes before any window is captured."""
    captured: list[object] = []
    monkeypatch.setattr(calibration, "capture_attention", lambda *a, **k: captured.append(a))
    cfg = load_config(preset=RECIPES, overrides=TINY + ["selectors.dsa.calibrate_params.seq_len=100000000",
                                                        "selectors.dsa.calibrate_params.rows=96"])
    before = copy.deepcopy(cfg)
    with pytest.raises(ConfigError, match=r"selectors\.dsa\.calibrate \(distill_indexer\) failed for "
                                          r"tiny-random-llama: distill: the training windows at seq_len 100000000: "
                                          r"token_windows: \d+ documents give \d+ tokens; 2 windows of 100000000 need"):
        calibration.calibrate_selectors(cfg, tiny, lambda line: None)
    assert cfg == before and captured == []
    assert not cache.exists() or not any(cache.iterdir())


def test_calibrate_params_take_several_lengths_and_refuse_one_the_corpus_cannot_fill(cache, tiny, monkeypatch):
    """``seq_len: [512, 100000000]`` (one indexer on windows of each length) is taken as the
    command's ``--seq-len 512 100000000``: the length the corpus cannot fill is refused by name
    before any window of either length is captured."""
    captured: list[object] = []
    monkeypatch.setattr(calibration, "capture_attention", lambda *a, **k: captured.append(a))
    cfg = load_config(preset=RECIPES, overrides=TINY + ["selectors.dsa.calibrate_params.seq_len=[512, 100000000]"])
    with pytest.raises(ConfigError, match=r"distill: the training windows at seq_len 100000000: token_windows"):
        calibration.calibrate_selectors(cfg, tiny, lambda line: None)
    assert captured == [] and (not cache.exists() or not any(cache.iterdir()))
    empty = load_config(preset=RECIPES, overrides=TINY + ["selectors.dsa.calibrate_params.seq_len=[]"])
    with pytest.raises(ConfigError, match=r"DistillConfig.seq_len must be an int >= 1 or a non-empty tuple"):
        calibration.calibrate_selectors(empty, tiny, lambda line: None)
    assert captured == []


def test_unknown_preset_is_refused():
    with pytest.raises(ConfigError, match=r"preset: unknown name 'recipe' \(did you mean 'recipes'\?\)"):
        load_config(preset="recipe")


def test_a_sweep_runs_calibrated_dsa_and_skip_softmax(cache, tiny, tmp_path):
    """Through run_sweep: dsa's indexer is fed each layer's hidden state; both runs finish."""
    recipes = yaml.safe_load(resources.files("kvsieve.eval").joinpath("configs", "recipes.yaml").read_text())
    entries = {k: recipes["selectors"][k] for k in ("dsa", "skip_softmax")}
    for e in entries.values():
        e["sparsities"] = [0.75]
    entries["dsa"]["calibrate_params"] |= TINY_DSA
    entries["skip_softmax"]["calibrate_params"] = {"length": 512, "num_texts": 1, "factors": [490, 500, 520, 560]}
    raw = {"model": "tiny-random", "output_dir": str(tmp_path / "out"),
           "tasks": {"passkey": {"lengths": [300], "depths": [50], "samples": 1}}, "selectors": entries}
    logs: list[str] = []
    result = run_sweep(from_dict(raw), loaded=tiny, progress=False, log=logs.append)
    assert {r["selector"]: r["status"] for r in result.rows} == {"dense": "ok", "dsa": "ok", "skip_softmax": "ok"}
    assert any("trained a DSA indexer" in line for line in logs)
    row = {r["selector"]: r for r in result.rows}
    assert float(row["dsa"]["achieved_sparsity"]) > 0.5  # 75 of 300 tokens per decode query
    assert float(row["skip_softmax"]["achieved_sparsity"]) > 0.0  # skipped tiles count as not computed


def test_skip_softmax_is_calibrated_on_the_layers_it_runs_on(cache, tiny):
    """The calibration reads only the layers the entry's plan selects, and they key the cache."""
    logs: list[str] = []
    only = [o for o in TINY if "dsa" not in o] + ["selectors.dsa=null", "selectors.skip_softmax.layers=[1]"]
    calibration.calibrate_selectors(load_config(preset=RECIPES, overrides=only), tiny, logs.append)
    assert "(1 layer samples of layers [1]," in logs[0], logs
    both = [o for o in TINY if "dsa" not in o] + ["selectors.dsa=null"]
    calibration.calibrate_selectors(load_config(preset=RECIPES, overrides=both), tiny, logs.append)
    assert "calibrated" in logs[1] and "(2 layer samples of layers [0, 1]," in logs[1], logs  # not reused
    assert len(list(cache.glob("calibrate_skip_softmax-*.json"))) == 2


class _WithBos:
    """The tiny model's tokenizer, plus a ``<bos>`` (id 7) before every text it encodes with its
    special tokens, as Gemma 3's does."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text, add_special_tokens=True):
        ids = self.tok.encode(text, add_special_tokens=False)
        return [7] + ids if add_special_tokens else ids

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_calibration_samples_start_like_the_eval_prompts_and_the_prefix_keys_the_cache(cache, tiny):
    """Gemma 3 sinks its attention on <bos>: samples without it skip far fewer tiles than its
    prompts, so the samples carry the tokenizer's special prefix and it is part of the cache key."""
    import dataclasses

    from kvsieve.eval.text_corpus import corpus_documents
    from kvsieve.selectors.common.text_windows import special_prefix, token_windows

    bos = dataclasses.replace(tiny, tokenizer=_WithBos(tiny.tokenizer))
    assert special_prefix(tiny.tokenizer) == [] and special_prefix(bos.tokenizer) == [7]
    essays = [d for d in corpus_documents() if d.source == "essays"]
    seqs = token_windows(bos.tokenizer, essays, 16, 2)
    assert [s.shape[1] for s in seqs] == [16, 16] and all(int(s[0, 0]) == 7 for s in seqs)
    assert int(token_windows(tiny.tokenizer, essays, 16, 1)[0][0, 0]) != 7
    only = [o for o in TINY if "dsa" not in o] + ["selectors.dsa=null"]
    logs: list[str] = []
    for lm in (tiny, bos):
        calibration.calibrate_selectors(load_config(preset=RECIPES, overrides=only), lm, logs.append)
    assert all("calibrated" in line for line in logs), logs  # the second did not reuse the first
    (with_prefix,) = [p for p in cache.glob("calibrate_skip_softmax-*.json") if "special_prefix" in p.read_text()]
    assert json.loads(with_prefix.read_text())["special_prefix"] == [7]
