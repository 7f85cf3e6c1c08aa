"""The plug-in under vLLM's tensor and pipeline parallelism together (CPU, ``mp`` executor): 2
tensor-parallel ranks x 2 pipeline stages, four workers, each engine launch checking both. The
model: a tiny random-weight Gemma 3 written here (Gemma 3 270M's attention: 4 query heads, 1 KV
head, five sliding-window layers to one full one, no soft-capping; 12 layers, so each stage holds
one full-attention layer) and, when its converted copy exists, Gemma 3 270M itself (same checks):

* dense through the plug-in gives the greedy tokens of vLLM's own attention in one process (fp32),
  and every captured layer call of each worker equals vLLM's own kernel and the Vanilla golden on
  that worker's shard (2 query heads, the 1 KV head vLLM replicates; its stage's layers only);
* quest (on whole vLLM blocks) and the third-party ``recent_blocks``: each worker runs the selector
  on its own shard of its stage's full-attention layers, and each call equals the Vanilla golden on
  that worker's selection.

vLLM 0.32's CPU worker sets up a pipeline stage > 0 only in the warm-up that a compiled model runs
(with ``--enforce-eager`` stage 1 fails its first step), so these engines trace the model once with
dynamo and run it eagerly (``run_engine.py --dynamo-eager``); docs/vllm.md, "Parallel serving".
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm.platforms", reason="vLLM is not installed (it runs in its own venv, see .ci/run)")

from test_engine import _captured, _check_golden, _run_engine, gemma_dir, model_dir  # noqa: E402, F401 (fixtures)

TP, PP = 2, 2
PARALLEL = ("--tensor-parallel-size", str(TP), "--pipeline-parallel-size", str(PP), "--dynamo-eager")
BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1|0|1"}  # worker r on core r % 2 (any machine has cores 0 and 1)
# a 700-token prompt: 6 blocks of 128, past the 512-token window. A KV cache of 256 MiB per worker
# and fewer batched tokens (the three prompts still fit one step): the tiny model's engine peaks at
# about 5 GB. SMALL unsets VLLM_CPU_KVCACHE_SPACE (whole GiB), which would override the 256 MiB.
ARGS = ("--prompt-tokens", "700", "--max-tokens", "6", "--dtype", "float32", "--kv-cache-mib", "256",
        "--max-num-batched-tokens", "2048")
SMALL = {"VLLM_CPU_KVCACHE_SPACE": None}


def write_tiny_gemma3(out: Path, tokenizer_dir: Path) -> Path:
    """A random-weight Gemma 3 (fp32, seed 0) with Gemma 3 270M's attention features and SmolLM2's
    tokenizer (the vocabulary is sized to it), saved where vLLM can load it."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    rope = {"full_attention": {"rope_theta": 1e6, "rope_type": "default"},
            "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}  # Gemma 3 270M's
    cfg = Gemma3TextConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=12,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                           sliding_window=512, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2,
                           rope_parameters=rope, attn_logit_softcapping=None, final_logit_softcapping=None,
                           max_position_embeddings=32768, tie_word_embeddings=True)
    torch.manual_seed(0)
    Gemma3ForCausalLM(cfg).to(torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="module", params=["tiny-gemma3", "gemma3-270m"])
def model(request, tmp_path_factory) -> Path:
    if request.param == "gemma3-270m":
        return request.getfixturevalue("gemma_dir")
    return write_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"), request.getfixturevalue("model_dir"))


@pytest.fixture(scope="module")
def vllm_one_process_tokens(model, tmp_path_factory) -> list[list[int]]:
    """vLLM's own attention, one process: the reference greedy tokens."""
    return _run_engine(model, tmp_path_factory.mktemp("own") / "own.json", *ARGS, **SMALL)["tokens"]


def _config(model: Path) -> dict:
    return json.loads((model / "config.json").read_text())


def _per_worker(records: list[dict], model: Path) -> list[list[dict]]:
    """The captured calls of each worker, after checking that every worker ran the full-attention
    layers of its own stage (the stages split the layers in order, every one held once per
    tensor-parallel rank) on its own shard of the heads (query heads divided by ``TP``, KV heads too
    or replicated when fewer), each call equal to the Vanilla golden (and, dense, vLLM's kernel)."""
    cfg = _config(model)
    full = {i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"}
    workers: dict[tuple[int, int], list[dict]] = {}
    for r in records:
        workers.setdefault((r["tp_rank"], r["pp_rank"]), []).append(r)
    assert sorted(workers) == [(t, p) for t in range(TP) for p in range(PP)]
    heads = (cfg["num_attention_heads"] // TP, max(cfg["num_key_value_heads"] // TP, 1))
    for t in range(TP):
        stages = [sorted({r["layer"] for r in workers[t, p]}) for p in range(PP)]
        assert sorted(sum(stages, [])) == sorted(full)  # each full layer on exactly one stage
        assert all(a[-1] < b[0] for a, b in zip(stages, stages[1:]))  # stages in layer order
        for p in range(PP):
            _check_golden(workers[t, p], set(stages[p]))
            assert {(r["num_q_heads"], r["num_kv_heads"]) for r in workers[t, p]} == {heads}
    return list(workers.values())


def test_dense_on_parallel_workers_equals_vllm_in_one_process(model, vllm_one_process_tokens, tmp_path):
    cap = tmp_path / "capture"
    plug = _run_engine(model, tmp_path / "plug.json", *ARGS, *PARALLEL, KVSIEVE_SELECTOR="dense",
                       KVSIEVE_CAPTURE=str(cap), **BIND, **SMALL)
    assert max(plug["prompt_lens"]) > _config(model)["sliding_window"]
    assert plug["tokens"] == vllm_one_process_tokens
    for recs in _per_worker(_captured(cap), model):
        assert all(r["selector"] is None and set(r["paths"].values()) == {"host_dense"} for r in recs)


@pytest.mark.parametrize("spec", ["quest:budget=256,page_size=128", "recent_blocks:block_size=16,num_blocks=4"])
def test_selector_equals_vanilla_golden_in_each_parallel_worker(model, spec, tmp_path):
    cap = tmp_path / "capture"
    res = _run_engine(model, tmp_path / "plug.json", *ARGS, *PARALLEL, KVSIEVE_SELECTOR=spec,
                      KVSIEVE_CAPTURE=str(cap), **BIND, **SMALL)
    assert all(len(t) == 6 for t in res["tokens"])
    name = spec.partition(":")[0]
    for recs in _per_worker(_captured(cap), model):
        assert all(r["selector"] == name for r in recs)
        decode = [r for r in recs if r["num_contexts"] == 0 and r["num_tokens"] > 0]
        assert decode and all(r["sparse"] and r["attended"] < r["dense"] for r in decode)
        if name == "quest":  # pages of one vLLM block: vLLM's paged kernel on per-head block tables
            assert all(r["paths"] == {"generation": "host_paged"} for r in decode)


def test_dsa_on_two_tensor_parallel_workers_equals_one_process(model, tmp_path):
    """DSA under tensor parallelism (2 workers, eager; pipeline stages need a traced model, which the
    indexer's feed refuses): each worker feeds its shard's layers the (replicated) hidden state, runs
    the indexer on the full-attention layers, and each call equals the Vanilla golden on its
    selection; the greedy tokens equal DSA in one process."""
    from test_engine import dsa_spec, random_indexer

    cfg = _config(model)
    full = {i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"}
    spec = dsa_spec(random_indexer(tmp_path / "indexer.pt", cfg["hidden_size"], cfg["num_hidden_layers"]))
    one = _run_engine(model, tmp_path / "one.json", *ARGS, KVSIEVE_SELECTOR=spec, **SMALL)
    cap = tmp_path / "capture"
    two = _run_engine(model, tmp_path / "two.json", *ARGS, "--tensor-parallel-size", str(TP),
                      KVSIEVE_SELECTOR=spec, KVSIEVE_CAPTURE=str(cap), VLLM_CPU_OMP_THREADS_BIND="0|1", **SMALL)
    assert two["tokens"] == one["tokens"]
    records = _captured(cap)
    assert {r["tp_rank"] for r in records} == set(range(TP))
    for rank in range(TP):
        recs = [r for r in records if r["tp_rank"] == rank]
        _check_golden(recs, full)
        assert {(r["num_q_heads"], r["num_kv_heads"]) for r in recs} == {
            (cfg["num_attention_heads"] // TP, max(cfg["num_key_value_heads"] // TP, 1))}
        decode = [r for r in recs if r["num_contexts"] == 0 and r["num_tokens"] > 0]
        assert decode and all(r["selector"] == "dsa" and r["sparse"] and r["attended"] < r["dense"] for r in decode)
