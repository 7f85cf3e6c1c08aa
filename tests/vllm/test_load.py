"""The plug-in under load in vLLM's offline engine (issue 43, item 1), CI-sized: the driver of
``benchmarks/vllm_load.py`` (its docstring: the workload, the counters) with 12 requests on
SmolLM2-135M in fp32, a KV cache of 16 blocks of 32 tokens, at most 4 running requests and 64
batched tokens per step (chunked prefill), prefix caching on.

For vLLM's own attention, dense through the plug-in, Quest and DSA (a random indexer, fp32 index
keys: with bf16 keys a last-bit difference between a batched and a lone step can swap two near-tied
tokens, ``SELECTORS`` in the benchmark): every finished request's greedy tokens equal the same
request run alone (and an aborted request's tokens are the start of its alone run), a request vLLM
preempted while decoding and recomputed included (the plug-in selects its recomputed generated tokens
as their decode steps did: docs/vllm.md, preemption); and the load really happened: vLLM preempted requests, requests were aborted mid-decode, blocks
were handed out again and cached prefix blocks were evicted and hit. Quest and DSA run with the plug-in's per-block state check on
(``KVSIEVE_CHECK_STATE=1``): a stale page summary or index key would end the engine, naming it.
The full-size run is the benchmark (docs/results/vllm_load.md)."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm.platforms", reason="vLLM is not installed (it runs in its own venv, see .ci/run)")

import test_engine  # noqa: E402

from benchmarks.vllm_load import SELECTORS, mismatches, mode_spec, parser, run_mode  # noqa: E402

model_dir = test_engine.model_dir  # the fixture: SmolLM2-135M converted once

CI_ARGS = ("--requests", "12", "--kv-blocks", "16", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
           "--suffix-tokens", "16,160", "--max-tokens", "16,48", "--abort-every", "4", "--abort-after", "3",
           "--max-steps", "2000", "--time-limit", "600")
ENGINE_TIMEOUT_S = 1200
QUEST_BUDGET, DSA_TOPK = 64, 64  # SELECTORS' quest budget and dsa index_topk, in tokens


@pytest.mark.parametrize("mode", ["own", "dense", "quest", "dsa"])
def test_under_load_every_request_equals_itself_alone(mode, model_dir, tmp_path):  # noqa: F811 (fixture)
    args = parser().parse_args(CI_ARGS)
    spec = mode_spec(mode, tmp_path)
    res = run_mode(str(model_dir), spec, args, tmp_path, check_state=mode in SELECTORS, timeout=ENGINE_TIMEOUT_S)
    figures, requests = res["figures"], res["requests"]
    assert mismatches(res) == []
    assert figures["finished"] + figures["aborts"] == len(requests) == args.requests
    assert figures["preempted_decoding"] > 0 and figures["aborts"] > 0, figures  # recomputed generated tokens
    assert figures["evictions"] > 0 and figures["blocks_reused"] > 0 and figures["prefix_cache_hit_tokens"] > 0, figures
    assert all(len(r["load"]) >= args.abort_after for r in requests if r["aborted"])  # aborted while decoding
    assert all(len(r["load"]) == r["max_tokens"] for r in requests if r["finished"])
    if mode in SELECTORS:  # every prompt is longer than the budget: each decode step selects
        budget = {"quest": QUEST_BUDGET, "dsa": DSA_TOPK}[mode]
        assert str(budget) in spec and min(r["prompt_len"] for r in requests) > budget


def test_workload_is_mixed_and_shares_prefixes():
    """The CI workload itself (no engine): mixed lengths, three prefix families of whole blocks."""
    from benchmarks.vllm_load import BLOCK_SIZE, _pair, make_workload

    args = parser().parse_args(CI_ARGS)
    work = make_workload(requests=args.requests, seed=args.seed, per_step=args.per_step, abort_every=args.abort_every,
                         abort_after=args.abort_after, suffix_tokens=_pair(args.suffix_tokens),
                         max_tokens=_pair(args.max_tokens))
    lens = [len(r.prompt) for r in work]
    assert max(lens) - min(lens) > 2 * BLOCK_SIZE
    firsts = {tuple(r.prompt[:BLOCK_SIZE]) for r in work}
    assert len(firsts) == 3  # three families, each shared by 4 requests
    assert sum(r.abort_after is not None for r in work) == 3


def test_under_load_with_kvsieve_drafts_every_request_equals_itself_alone(model_dir, tmp_path):  # noqa: F811
    """vLLM speculating 3 tokens per step with kvsieve's drafter (Quest drafts, vLLM's own attention
    verifies; docs/lossless.md) under the same load, with the per-block state check on: the same rule,
    vLLM really preempted, aborted and drafted, and most drafts were accepted (garbage drafts would not
    be: the CI prompts are longer than Quest's budget, so every draft step selects)."""
    args = parser().parse_args([*CI_ARGS, "--speculate", "3"])
    res = run_mode(str(model_dir), mode_spec("quest", tmp_path), args, tmp_path, check_state=True,
                   timeout=ENGINE_TIMEOUT_S)
    figures = res["figures"]
    assert mismatches(res) == []
    assert figures["finished"] + figures["aborts"] == args.requests
    assert figures["preempted_decoding"] > 0 and figures["aborts"] > 0 and figures["prefix_cache_hit_tokens"] > 0
    assert figures["accepted"] > figures["drafted"] / 2 > 0, figures
