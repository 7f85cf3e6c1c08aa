"""A third-party selector registers its own calibration step, and the sweep runs it without knowing it:
a toy selector (streaming whose sink count is measured on the model) and its step, both registered
here, go through the config check, the calibration (cached, then reused) and ``kvsieve list``."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from kvsieve.cli import main as kvsieve_main
from kvsieve.eval import calibration
from kvsieve.eval.config import ConfigError, from_dict
from kvsieve.eval.model import load_model
from kvsieve.selectors.common.text_windows import token_windows
from kvsieve.selectors.streaming import StreamingSelector
from kvsieve.sparse import CalibrationStep, create_selector, register_calibration_step, register_selector
from kvsieve.sparse.calibration import CALIBRATION_STEPS
from kvsieve.sparse.registry import SELECTORS


@dataclass(frozen=True)
class ToySinksConfig:
    """Streaming with a measured sink count: ``num_sink`` comes from the ``count_sinks`` step."""

    budget: int = 64
    num_sink: int | None = None

    def __post_init__(self) -> None:
        if self.num_sink is None or not 0 <= self.num_sink < self.budget:
            raise ValueError(f"toy_sinks.num_sink must be in [0, budget={self.budget}) (run the calibration step "
                             f"count_sinks), got {self.num_sink}")


class ToySinks(StreamingSelector):
    """Streaming whose sink count was measured on the model."""

    name = "toy_sinks"
    config_class = ToySinksConfig


class CountSinks(CalibrationStep):
    """The fewest leading positions holding ``mass`` of the last query's attention (most over layers and heads)."""

    name = "count_sinks"
    selector = "toy_sinks"
    options = {"length": 128, "mass": 0.1}

    def resolve(self, options, ctx):
        return options | {"layers": ctx.layers}

    def run(self, options, ctx, stem):
        path = stem.with_suffix(".json")
        if path.is_file():
            count = json.loads(path.read_text())["num_sink"]
            ctx.log(f"{ctx.label}: reused {count} sinks for {ctx.model_name} ({path})")
            return {"num_sink": count}
        essays = [d for d in ctx.documents() if d.source == "essays"]
        windows = token_windows(ctx.tokenizer, essays, options["length"], 1)
        samples, scale = ctx.last_queries(windows, set(options["layers"]))
        count = 0
        for q, k, _ in samples:  # q [1, Hq, D], k [L, Hkv, D]
            k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
            p = torch.softmax(torch.einsum("hd,lhd->hl", q[0], k) * scale, -1)
            count = max(count, int((p.cumsum(-1) < options["mass"]).sum(-1).max()) + 1)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"num_sink": count, **options}))
        ctx.log(f"{ctx.label}: counted {count} sinks for {ctx.model_name} on layers {options['layers']}")
        return {"num_sink": count}


@pytest.fixture
def toy():
    saved = dict(SELECTORS._classes), dict(CALIBRATION_STEPS._classes)
    register_selector(ToySinks)
    register_calibration_step(CountSinks)
    yield
    for reg, before in zip((SELECTORS, CALIBRATION_STEPS), saved):
        reg._classes.clear()
        reg._classes.update(before)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(calibration, "calibration_dir", lambda: tmp_path / "prepared")
    return tmp_path / "prepared"


def _raw(entry: dict) -> dict:
    return {"model": "tiny-random", "tasks": {"passkey": {"lengths": [200]}}, "selectors": {"toy": entry}}


TOY = {"selector": "toy_sinks", "sparsities": [0.5], "calibrate": "count_sinks", "calibrate_params": {"mass": 0.1},
       "layers": [1]}


def test_a_registered_step_calibrates_its_selector_and_is_reused(toy, cache):
    cfg = from_dict(_raw(TOY))  # uncalibrated, the toy config would be refused: the check waits for the step
    tiny = load_model("tiny-random")
    logs: list[str] = []
    first = calibration.calibrate_selectors(cfg, tiny, logs.append)
    (spec,) = first.selectors
    count = spec.params["num_sink"]
    assert logs == [f"kvsieve eval: toy: counted {count} sinks for tiny-random-llama on layers [1]"]
    assert 0 < count < 100  # the tiny model's attention is nearly flat: about a tenth of 128 positions
    (kept,) = cache.glob("count_sinks-tiny-random-llama-*.json")
    assert json.loads(kept.read_text()) == {"num_sink": count, "length": 128, "mass": 0.1, "layers": [1]}
    assert isinstance(create_selector("toy_sinks", **spec.sparse_config(spec.resolve(200)[0]).params), ToySinks)
    logs.clear()
    again = calibration.calibrate_selectors(cfg, tiny, logs.append)
    assert again.selectors == first.selectors and logs == [
        f"kvsieve eval: toy: reused {count} sinks for tiny-random-llama ({kept})"]


@pytest.mark.parametrize("entry,message", [
    ({"selector": "quest", "budgets": [16], "calibrate": "count_sinks"},
     r"selectors\.toy\.calibrate: 'count_sinks' calibrates selector 'toy_sinks', not 'quest'"),
    (TOY | {"calibrate_params": {"masses": 0.2}},
     r"selectors\.toy\.calibrate_params: unknown option\(s\) \['masses'\]; valid: \['length', 'mass'\]"),
])
def test_a_registered_step_is_checked_like_a_builtin(toy, entry, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(_raw(entry))


def test_a_registered_step_is_listed(toy, capsys):
    assert kvsieve_main(["list", "calibration"]) == 0
    out = capsys.readouterr().out
    assert "count_sinks" in out and "calibrates selector 'toy_sinks'; calibrate_params: length=128, mass=0.1" in out
    assert "distill_indexer" in out and "calibrate_skip_softmax" in out
    assert kvsieve_main(["list", "prepare"]) == 0  # the former name docs/eval.md taught lists the same
    assert capsys.readouterr().out == out


def test_a_step_without_run_or_selector_is_refused_at_registration(toy):
    class NoRun(CalibrationStep):
        name, selector = "no_run", "toy_sinks"

    class NoSelector(CountSinks):
        name, selector = "no_selector", ""

    with pytest.raises(TypeError, match=r"calibration step 'no_run' \(.*NoRun\) does not override run"):
        register_calibration_step(NoRun)
    with pytest.raises(ValueError, match=r"calibration step 'no_selector' \(.*NoSelector\) names no `selector`"):
        register_calibration_step(NoSelector)
    assert "no_run" not in CALIBRATION_STEPS.available() and "no_selector" not in CALIBRATION_STEPS.available()
