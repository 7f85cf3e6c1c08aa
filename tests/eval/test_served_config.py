"""``kvsieve eval --engine vllm`` without vLLM: what it refuses by name, the engine in a run's
identity, the eval's stop rule on tokens generated elsewhere, and the per-prompt agreement of two
output folders (the engine runs themselves: tests/vllm/test_eval_served.py)."""
from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

from kvsieve.eval.config import ConfigError, from_dict, load_config
from kvsieve.eval.run_plan import compute_run_id, plan_runs, run_identity
from kvsieve.eval.served.agreement import answer_text, compare_outputs, format_agreement
from kvsieve.eval.served.launch import ENV_PYTHON, vllm_python
from kvsieve.eval.served.protocol import PLUGIN_DENSE, cache_salt, check_served, request_setting

BASE = {"model": "smollm2", "engine": "vllm", "tasks": {"passkey": {"lengths": [1024]}},
        "selectors": {"quest": {"budgets": [64, 256], "params": {"page_size": 16}}}}


def _cfg(**changes: object) -> object:
    raw = {**BASE, **changes}
    return from_dict(raw)


@pytest.mark.parametrize("changes, message", [
    ({"tasks": {"fidelity": {"lengths": [256]}}}, "tasks.fidelity: a fidelity task"),
    ({"check": 2}, "check: the golden check"),
    ({"selectors": {"snapkv": {"budgets": [256], "phases": ["context"]}}}, "selectors.snapkv: not served by the vLLM "
                                                                          "plug-in: .*evicts prompt tokens"),
    ({"selectors": {"dsa": {"budgets": [64]}}}, "selectors.dsa: not served .*projections"),
    ({"selectors": {"quest": {"budgets": [64], "layers": [2, 3]}}}, "selectors.quest: layers / layer_types"),
    ({"selectors": {"rocketkv": {"budgets": [64], "phases": ["context", "generation"]}}},
     "selectors.rocketkv: not served .*evicts prompt tokens"),
    ({"selectors": {"quest": {"budgets": [64, 65], "params": {"page_size": 16}}}}, "budgets entries|whole number"),
])
def test_what_the_vllm_path_cannot_run_exactly_is_refused_by_name(changes, message):
    with pytest.raises(ConfigError, match=message):
        check_served(_cfg(**changes), calibrated=True)


def test_a_model_without_a_checkpoint_folder_is_refused_before_anything_loads(tmp_path):
    from kvsieve.eval.runner import run_sweep

    with pytest.raises(ConfigError, match="model .*'tiny-random' is built in memory"):
        run_sweep(_cfg(model="tiny-random", output_dir=str(tmp_path)), vllm_python=sys.executable)


def test_an_unknown_engine_is_refused():
    with pytest.raises(ConfigError, match="engine: unknown name 'vlm'"):
        _cfg(engine="vlm")


def test_the_engine_is_part_of_a_runs_identity_and_transformers_ids_are_unchanged():
    served, plain = _cfg(), _cfg(engine="transformers")
    s_runs = [r for c in plan_runs(served, "m") for r in c]
    t_runs = [r for c in plan_runs(plain, "m") for r in c]
    # the vLLM path adds one plug-in dense run per entry and length
    assert [r.folder for r in s_runs] == [r.folder for r in t_runs] + ["passkey__1024__m__quest__dense"]
    for s, t in zip(s_runs, t_runs):
        assert compute_run_id(run_identity(served, s)) != compute_run_id(run_identity(plain, t))
        assert "engine" not in run_identity(plain, t)  # ids made before the field existed stay valid
        assert run_identity(served, s)["engine"]["name"] == "vllm"


def test_requests_carry_their_budget_and_context_selectors_get_one_cache_salt_per_setting():
    cfg = _cfg(selectors={"quest": {"budgets": [64], "params": {"page_size": 16}},
                          "oracle_topk": {"budgets": [64], "phases": ["context", "generation"]}})
    runs = {r.folder.split("__", 3)[3]: r for c in plan_runs(cfg, "m") for r in c if r.selector is not None}
    assert request_setting(runs["quest__b64"].budget) == {"budget": 64}
    assert request_setting(runs["quest__dense"].budget) == {"dense": True}
    assert runs["quest__dense"].budget.label == PLUGIN_DENSE
    assert cache_salt(runs["quest__b64"].selector, runs["quest__b64"].budget) is None  # dense prompt K/V: shared
    salts = {cache_salt(runs[k].selector, runs[k].budget) for k in ("oracle_topk__b64", "oracle_topk__dense")}
    assert len(salts) == 2 and None not in salts


@pytest.mark.parametrize("name", ["served", "served_smollm2"])
def test_the_served_presets_name_every_selector_the_plugin_serves_at_three_densities(name):
    cfg = load_config(preset=name)
    assert cfg.engine == "vllm"
    assert sorted(s.selector for s in cfg.selectors) == ["block_select", "dsa", "oracle_topk", "quest", "streaming"]
    assert all(len(s.sparsities) == 3 for s in cfg.selectors)
    check_served(cfg, calibrated=False)  # every entry but dsa (calibrated per model) is checked here


def test_the_quick_preset_through_vllm_is_refused_naming_the_quick_served_preset():
    with pytest.raises(ConfigError, match=r"tasks.fidelity: .*generation tasks only \(the quick preset's servable "
                                          r"part: --preset quick_served\)"):
        check_served(load_config(preset="quick", overrides=["engine=vllm"]), calibrated=False)
    no_fidelity = load_config(preset="quick", overrides=["engine=vllm", "tasks.fidelity=null"])
    with pytest.raises(ConfigError, match=r"selectors.snapkv: not served .*--preset quick_served\)$"):
        check_served(no_fidelity, calibrated=False)


def test_the_quick_served_preset_is_the_quick_presets_servable_part_and_plans():
    served, quick = load_config(preset="quick_served"), load_config(preset="quick")
    assert served.engine == "vllm" and served.model == quick.model == "smollm2"
    check_served(served, calibrated=False)
    assert served.tasks == [t for t in quick.tasks if t.name != "fidelity"]
    assert served.selectors == [s for s in quick.selectors if s.selector != "snapkv"]
    runs = [r for cell in plan_runs(served, "m") for r in cell]
    # dense + 8 selector budgets + 4 plug-in dense runs, in each of the two cells
    assert len(runs) == 2 * (1 + 8 + 4)
    assert sum(r.folder.endswith("__dense") for r in runs) == 2 * 4


def test_no_vllm_python_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_PYTHON, str(tmp_path / "missing" / "python"))
    with pytest.raises(ConfigError, match="does not exist"):
        vllm_python()
    monkeypatch.delenv(ENV_PYTHON)
    monkeypatch.setenv("KVSIEVE_CACHE", str(tmp_path))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="vLLM is not importable .* no vLLM environment was found"):
        vllm_python()


class _Tok:
    """Token i decodes to chr(ord('a') + i); token 9 is EOS."""

    eos_token_id = 9

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids if not (skip_special_tokens and i == 9))


def test_the_answer_ends_at_eos_or_at_the_stop_pattern_as_the_sessions_loop_ends_it():
    tok = _Tok()
    assert answer_text(tok, [0, 1, 9, 2], None) == "ab"  # EOS ends it (and is dropped when decoded)
    assert answer_text(tok, [0, 1, 2, 3], "bc") == "abc"  # the first token after which the text matches
    assert answer_text(tok, [0, 1, 2, 3], None) == "abcd"


def _write_run(folder: Path, rows: list[tuple[int, str, float]]) -> None:
    folder.mkdir(parents=True)
    with (folder / "predictions.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, ["sample", "depth", "prediction", "score"])
        w.writeheader()
        w.writerows({"sample": s, "depth": 50.0, "prediction": p, "score": sc} for s, p, sc in rows)


def test_two_output_folders_are_compared_prompt_by_prompt(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _write_run(a / "passkey__512__m__dense__full", [(0, "12345", 1.0), (1, "777", 1.0)])
    _write_run(b / "passkey__512__m__dense__full", [(0, "12345", 1.0), (1, "777", 1.0)])
    _write_run(a / "passkey__512__m__quest__b64", [(0, "12345", 1.0), (1, "1", 0.0)])
    _write_run(b / "passkey__512__m__quest__b64", [(0, "12345.", 1.0), (1, "1", 0.0)])
    _write_run(b / "passkey__512__m__quest__dense", [(0, "12345", 1.0), (1, "777", 1.0)])  # only in b: skipped
    rows = {r.run.split("__", 3)[3]: r for r in compare_outputs(a, b)}
    assert set(rows) == {"dense__full", "quest__b64"}
    assert (rows["dense__full"].same_answer, rows["dense__full"].n) == (2, 2)
    assert (rows["quest__b64"].same_answer, rows["quest__b64"].same_pass, rows["quest__b64"].differ_on) == (1, 2, "0@50.0")
    text = format_agreement(list(rows.values()))
    assert "dense            2/2 = 100% same answer" in text and "quest            1/2 = 50% same answer" in text
    _write_run(b / "passkey__1024__m__dense__full", [(3, "1", 1.0)])
    _write_run(a / "passkey__1024__m__dense__full", [(4, "1", 1.0)])
    with pytest.raises(ValueError, match="passkey__1024__m__dense__full: the prompts differ"):
        compare_outputs(a, b)
