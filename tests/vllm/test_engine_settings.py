"""Sparsity per request inside vLLM's offline engine (vLLM venv, SmolLM2-135M, fp32): requests of
one batch carry different budgets, ``dense`` and a budget covering the whole context; each request's
greedy tokens equal the same prompt run with its setting as the process default, in plain steps and
with chunked prefill and preemption; settings the process's selector cannot honour are refused by
name at admission and the engine serves the batch after them. The settings reach the layers through the ``vllm.logits_processors`` entry point
(docs/vllm.md, "Per-request settings")."""
from __future__ import annotations

import json
from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm.platforms", reason="vLLM is not installed (it runs in its own venv, see .ci/run)")

import test_engine  # noqa: E402
from test_engine import _run_engine  # noqa: E402

model_dir = test_engine.model_dir  # the SmolLM2 checkpoint fixture

PROCESS = "quest:budget=48,page_size=16"
ARGS = ("--prompt-tokens", "380", "--max-tokens", "12", "--dtype", "float32", "--max-model-len", "512")
# one request each, cycling through run_engine's prompts: two short ones and the 380-token one (index 2)
SETTINGS = [None, "dense=true", None, "budget=32", {"budget": 64}, "budget=32", {"dense": True}, None, {"budget": 64},
            "budget=2048", "budget=32", "dense=true", "budget=48", "budget=2048", "budget=2048"]
# the process default each setting equals ("budget=48" is the default itself; 2048 covers every context)
ALONE = {None: PROCESS, "budget=48": PROCESS, "budget=32": "quest:budget=32,page_size=16",
         '{"budget": 64}': "quest:budget=64,page_size=16", "dense=true": "dense", '{"dense": true}': "dense",
         "budget=2048": "dense"}
REFUSED = {"page_size=32": "field 'page_size' is a field of selector 'quest' fixed for the process",
           "budget=8": "field 'budget': quest.budget: a budget of 8 tokens is not a whole number",
           "index_topk=64": "field 'index_topk' is not a per-request field",
           "budget=abc": "field 'budget' must be a whole number of tokens"}
# a cache of 640 tokens (five 128-token blocks) and 64-token prompt chunks: the 380-token prompt is
# prefilled in chunks beside decoding rows and grows into a fourth block while others hold the rest,
# so vLLM preempts and later resumes requests (each comes back as a new row with its own settings)
PREEMPTING = ("--kv-cache-mib", "30", "--max-num-batched-tokens", "64")


def _key(setting: object) -> object:
    return setting if setting is None or isinstance(setting, str) else json.dumps(setting)


def test_settings_processor_entry_point_is_installed():
    found = [e.value for e in entry_points(group="vllm.logits_processors") if "kvsieve" in e.value]
    assert found == ["kvsieve.integrations.vllm.settings_processor:KvsieveRequestSettings"], (
        "kvsieve's vllm.logits_processors entry point is not installed in this venv: pip install --no-deps -e . "
        f"(.ci/run does); found {found}")


def test_processor_follows_the_batch_and_changes_no_logit(monkeypatch):
    """The logits processor alone: admission refuses by name, ``update_state`` keeps each batch row's
    setting through vLLM's removals, additions and moves (the rows the metadata builder reads), and
    the logits pass unchanged."""
    import torch
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    from kvsieve.integrations.vllm import settings_processor
    from kvsieve.integrations.vllm.request_settings import RequestSetting, row_prompt_lens, row_settings

    monkeypatch.setenv("KVSIEVE_SELECTOR", PROCESS)
    settings_processor._plugin_config.cache_clear()
    try:
        cls = settings_processor.KvsieveRequestSettings
        with pytest.raises(ValueError, match="field 'page_size' is a field of selector 'quest'"):
            cls.validate_params(SamplingParams(extra_args={"kvsieve": "page_size=32"}))
        cls.validate_params(SamplingParams(extra_args={"kvsieve": "budget=32"}))
        proc = cls(None, torch.device("cpu"), False)
        params = [SamplingParams(extra_args=e) for e in ({"kvsieve": "budget=32"}, None, {"kvsieve": {"dense": True}})]
        proc.update_state(BatchUpdate(3, removed=[], added=[(i, p, [7] * (5 + i), []) for i, p in enumerate(params)],
                                      moved=[]))
        b32, dense = RequestSetting(knob=(("budget", 32),)), RequestSetting(dense=True)
        assert row_settings(3) == (b32, None, dense) and row_prompt_lens(3).tolist() == [5, 6, 7]
        proc.update_state(BatchUpdate(2, removed=[0], added=[], moved=[(2, 0, MoveDirectionality.UNIDIRECTIONAL)]))
        assert row_settings(2) == (dense, None) and row_prompt_lens(2).tolist() == [7, 6]
        proc.update_state(BatchUpdate(2, removed=[], added=[], moved=[(0, 1, MoveDirectionality.SWAP)]))
        assert row_settings(2) == (None, dense)
        logits = torch.randn(2, 7)
        assert proc.apply(logits) is logits and proc.is_argmax_invariant()
        # vLLM's V2 model runner builds it with its request state, not a device: refused while the plug-in is on
        with pytest.raises(NotImplementedError, match="V2 model runner is in use"):
            cls(None, object())
    finally:
        settings_processor._plugin_config.cache_clear()


@pytest.fixture(scope="module")
def alone(model_dir, tmp_path_factory) -> dict[str, dict]:
    """The three prompts run with each setting as the process default."""
    out = tmp_path_factory.mktemp("alone")
    runs = {spec: _run_engine(model_dir, out / f"alone{i}.json", *ARGS, KVSIEVE_SELECTOR=spec)
            for i, spec in enumerate(sorted(set(ALONE.values())))}
    # on the long prompt every other setting gives tokens other than the process default's (and budget 32 other
    # than dense), so a setting that did not reach its rows would show
    long_prompt = {spec: run["tokens"][2] for spec, run in runs.items()}
    assert all(t != long_prompt[PROCESS] for spec, t in long_prompt.items() if spec != PROCESS), long_prompt
    assert long_prompt["quest:budget=32,page_size=16"] != long_prompt["dense"]
    return runs


@pytest.mark.parametrize("schedule", ["plain", "preempting"])
def test_each_request_equals_its_setting_run_as_the_process_default(model_dir, alone, tmp_path, schedule):
    refused = [a for r in REFUSED for a in ("--refused", r)] if schedule == "plain" else []
    mixed = _run_engine(model_dir, tmp_path / "mixed.json", *ARGS, "--settings", json.dumps(SETTINGS), *refused,
                        *(PREEMPTING if schedule == "preempting" else ()), KVSIEVE_SELECTOR=PROCESS,
                        **({"VLLM_CPU_KVCACHE_SPACE": None} if schedule == "preempting" else {}))
    for (setting, message), error in zip(REFUSED.items(), mixed["refused"]):
        assert error is not None and message in error, (setting, error)
    assert len(mixed["refused"]) == len(refused) // 2
    assert (mixed["preemptions"] > 0) == (schedule == "preempting"), mixed["preemptions"]
    assert len(mixed["tokens"]) == len(SETTINGS)
    for i, setting in enumerate(SETTINGS):
        want = alone[ALONE[_key(setting)]]["tokens"][i % 3]
        assert mixed["tokens"][i] == want, (i, setting, ALONE[_key(setting)])
