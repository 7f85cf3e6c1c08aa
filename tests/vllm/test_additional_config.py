"""The plug-in configured the vLLM way (``--additional-config '{"kvsieve": {...}}'``,
:func:`kvsieve.integrations.vllm.config.read_plugin_config`) without vLLM: each key says what its
environment variable says, every malformed entry, unknown key, setting given twice or second route
is refused naming it, and the state's one start-up line says what is served."""
from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
import torch

from kvsieve.integrations.vllm.config import ADDITIONAL_KEYS, read_plugin_config
from kvsieve.integrations.vllm.startup import check_plugin_config
from kvsieve.integrations.vllm import state as state_module


def _entry(**settings: object) -> dict[str, object]:
    return {"kvsieve": settings}


def test_entry_says_what_the_environment_says(tmp_path):
    assert read_plugin_config({}, _entry(selector="quest", budget=256, page_size=16)) == \
        read_plugin_config({"KVSIEVE_SELECTOR": "quest:budget=256,page_size=16"})
    assert read_plugin_config({}, _entry(selector="dense")) == read_plugin_config({"KVSIEVE_SELECTOR": "dense"})
    settings = dict(backend="vanilla", capture=str(tmp_path), check_state=True, prompt_settings=True)
    env = {ADDITIONAL_KEYS[k]: str(v) for k, v in settings.items()}
    assert read_plugin_config({}, _entry(selector="dsa", index_topk=16, **settings)) == \
        read_plugin_config({**env, "KVSIEVE_SELECTOR": "dsa:index_topk=16"})
    path = tmp_path / "kvsieve.yaml"
    path.write_text("selector: streaming\nparams: {budget: 64, num_sink: 4}\ndense_layers: [0, -1]\n"
                    "phases: [generation]\ncheck_state: true\n")
    from_file = read_plugin_config({}, _entry(config=str(path), backend="vanilla"))
    assert from_file == read_plugin_config({"KVSIEVE_CONFIG": str(path), "KVSIEVE_BACKEND": "vanilla"})
    assert from_file.check_state and from_file.sparse.dense_layers == (0, -1)
    # the file's plan keys sit beside "selector" in the entry
    assert read_plugin_config({}, _entry(selector="streaming", budget=64, num_sink=4, dense_layers=[0, -1],
                                         phases=["generation"], check_state=True)).sparse == from_file.sparse


@pytest.mark.parametrize("additional", [None, {}, {"other_plugin": 1}, object()])
def test_no_entry_no_plugin(additional):
    assert read_plugin_config({}, additional) is None


@pytest.mark.parametrize("entry,message", [
    ("quest", r"must be a mapping of settings"),
    ({"budget": 256}, r"exactly one of 'selector' .* or 'config'"),
    ({"selector": "quest", "config": "k.yaml"}, r"exactly one of 'selector'"),
    ({"selector": 3}, r"'selector' must be a selector name or 'dense', got 3"),
    ({"selector": "dense", "budget": 8}, r"selector 'dense' takes no \['params'\]"),
    ({"selector": "quest", "backend": 1}, r"'backend' must be a non-empty string, got 1"),
    ({"selector": "quest", "capture": ""}, r"'capture' must be a non-empty string"),
    ({"selector": "quest", "check_state": "yes"}, r"'check_state' must be true or false, got 'yes'"),
    ({"selector": "quest", "prompt_settings": 1}, r"'prompt_settings' must be true or false, got 1"),
    ({"selector": "quest", "dense_layers": 0}, r"dense_layers must be a list, got 0"),
    ({"selector": "quest", "phases": ["prefill"]}, r"phases entries must be in"),
])
def test_malformed_entry_refused_by_name(entry, message):
    with pytest.raises(ValueError, match=message):
        read_plugin_config({}, {"kvsieve": entry})


def test_config_route_refusals(tmp_path):
    path = tmp_path / "kvsieve.json"
    path.write_text('{"selector": "quest", "params": {"budget": 64}, "backend": "torch", "check_state": false}')
    with pytest.raises(ValueError, match=r"unknown keys \['budget'\] beside 'config'"):
        read_plugin_config({}, _entry(config=str(path), budget=32))
    for key, value in (("backend", "vanilla"), ("check_state", True)):
        with pytest.raises(ValueError, match=rf"\['{key}'\] given twice, in the entry and in the file"):
            read_plugin_config({}, _entry(config=str(path), **{key: value}))
    with pytest.raises(ValueError, match=r"KVSIEVE_CONFIG=.*unknown keys \['window'\]"):
        path.write_text('{"selector": "quest", "window": 3}')
        read_plugin_config({}, _entry(config=str(path)))


@pytest.mark.parametrize("variable", sorted(ADDITIONAL_KEYS.values()))
def test_both_routes_refused(variable):
    with pytest.raises(ValueError, match=rf"'kvsieve' and the environment's \['{variable}'\] both configure"):
        read_plugin_config({variable: "1"}, _entry(selector="quest"))


@pytest.mark.parametrize("entry,message", [
    ({"selector": "quest", "bogus": 1}, r"bogus.*accepted fields"),
    ({"selector": "nosuch"}, r"unknown selector"),
    ({"selector": "snapkv"}, r"evicts prompt tokens"),
    ({"selector": "quest", "budget": 8}, r"budget must be >= page_size"),
])
def test_selector_refusals_of_the_entry(entry, message):
    """What the environment's selector is refused for, the entry's is refused for (an unknown key
    beside ``selector`` is an unknown field of the selector)."""
    with pytest.raises(ValueError, match=message):
        check_plugin_config(read_plugin_config({}, {"kvsieve": entry}), device="cpu")


def _vllm_config(additional: dict[str, object]) -> SimpleNamespace:
    return SimpleNamespace(
        additional_config=additional,
        model_config=SimpleNamespace(max_model_len=256, enable_prompt_embeds=False,
                                     hf_config=SimpleNamespace(num_hidden_layers=6, hidden_size=32)),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=256),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1),
        speculative_config=None, compilation_config=SimpleNamespace(mode=0))


@pytest.mark.parametrize("entry,line", [
    ({"selector": "quest", "budget": 64, "dense_layers": [0, -1]},
     r"serves selector 'quest' \(budget=64, .*page_size=16.*\) on layers 1-4 of 6 \(dense: 0,5\), "
     r"phases \['generation'\], backend 'torch'"),
    ({"selector": "dense"}, r"serves dense attention on all 6 layers"),
])
def test_state_logs_one_line(monkeypatch, caplog, entry, line):
    monkeypatch.setattr(state_module, "_STATE", None)
    for variable in ADDITIONAL_KEYS.values():
        monkeypatch.delenv(variable, raising=False)
    with caplog.at_level(logging.INFO, logger="vllm.kvsieve"):
        state_module.plugin_state(_vllm_config({"kvsieve": entry}), torch.device("cpu"), state_module.WorkerRanks())
    served = [r.getMessage() for r in caplog.records if r.name == "vllm.kvsieve"]
    assert len(served) == 1 and "\n" not in served[0]
    assert "--additional-config 'kvsieve'" in served[0]
    assert re.search(line, served[0]), served[0]
