"""Run vLLM's offline engine once (in its own process) and write the greedy tokens as JSON.

``python run_engine.py MODEL_DIR OUT_JSON [--prompt-tokens N] [--max-tokens M]``; the kvsieve
plug-in is on or off as the environment says (``KVSIEVE_SELECTOR`` / ``KVSIEVE_CONFIG``) or
``--additional-config`` (JSON, vLLM's ``additional_config``);
``--settings`` gives each request a per-request kvsieve setting, ``--refused`` sends settings
expected to be refused (each alone, before the batch) and records vLLM's error.
Prompts: two short chat-style prompts, plus (with ``--prompt-tokens``) one long prompt of that
many tokens cut from repeated text (``--long-prompts`` of them, each starting a word further into it),
so a sparse selector has more context than its budget."""
from __future__ import annotations

import argparse
import json
import time

PROMPTS = ["The capital of France is", "Write one sentence about the sea:"]
FILLER = ("The archive kept letters from sailors, merchants and clerks; each described the weather, the cargo, "
          "the price of grain and the names of the harbours they passed. ")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--prompt-tokens", type=int, default=0)
    ap.add_argument("--long-prompts", type=int, default=1, help="how many long prompts (--prompt-tokens each)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention-backend", default=None, help="e.g. TRITON_ATTN (CUDA; the CPU platform ignores it)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--pipeline-parallel-size", type=int, default=1)
    ap.add_argument("--kv-cache-mib", type=int, default=None,
                    help="KV cache per worker in MiB (instead of VLLM_CPU_KVCACHE_SPACE's whole GiB; unset that)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--settings", default=None,
                    help="JSON list of per-request kvsieve settings (null, a mapping or a 'budget=256' string), one "
                         "request each, cycling through the prompts")
    ap.add_argument("--refused", action="append", default=[],
                    help="a kvsieve setting sent alone (on the first prompt) before the batch; its error is recorded")
    ap.add_argument("--additional-config", default=None, help="JSON: vLLM's additional_config")
    ap.add_argument("--speculate", type=int, default=0,
                    help="K: vLLM speculates K tokens per step with kvsieve's drafter (docs/lossless.md)")
    ap.add_argument("--speculative-config", default=None, help="JSON: vLLM's speculative_config, as given")
    ap.add_argument("--logprobs", type=int, default=None, help="record each generated token's top logprobs")
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sample, seeded per request")
    ap.add_argument("--dynamo-eager", action="store_true",
                    help="trace the model once with dynamo, run it eagerly (instead of --enforce-eager): vLLM's CPU "
                         "worker sets up pipeline stages > 0 only in the warm-up this mode runs")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.exceptions import VLLMValidationError

    # one process (no engine-core or worker process): each would import vLLM again; with tensor or
    # pipeline parallelism one worker process per rank ("mp")
    parallel = args.tensor_parallel_size * args.pipeline_parallel_size > 1
    extra = {"compilation_config": {"mode": 2, "backend": "eager"}} if args.dynamo_eager else {}  # DYNAMO_TRACE_ONCE
    if args.kv_cache_mib:
        extra["kv_cache_memory_bytes"] = args.kv_cache_mib << 20
    if args.max_num_batched_tokens:
        extra["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.additional_config:
        extra["additional_config"] = json.loads(args.additional_config)
    if args.speculate:
        from kvsieve.integrations.vllm.draft_steps import DRAFTER

        extra["speculative_config"] = {"method": "custom_class", "model": DRAFTER,
                                       "num_speculative_tokens": args.speculate}
    if args.speculative_config:
        extra["speculative_config"] = json.loads(args.speculative_config)
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=not args.dynamo_eager,
              max_num_seqs=4, seed=0, disable_log_stats=False, distributed_executor_backend="mp" if parallel else "uni",
              tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
              attention_config={"backend": args.attention_backend} if args.attention_backend else None, **extra)
    tok = llm.get_tokenizer()
    prompts = [TokensPrompt(prompt_token_ids=tok.encode(p)) for p in PROMPTS]
    for i in range(args.long_prompts if args.prompt_tokens else 0):  # each starts i words into the filler
        ids = tok.encode((FILLER * (args.prompt_tokens // 20 + 1)).split(" ", i)[i])
        prompts.append(TokensPrompt(prompt_token_ids=ids[: args.prompt_tokens - 8] + tok.encode(" The price of grain was")))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True,
                            logprobs=args.logprobs, seed=0 if args.temperature > 0 else None)
    refused = []
    for setting in args.refused:
        try:
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, extra_args={"kvsieve": setting}),
                         use_tqdm=False)
            refused.append(None)
        except VLLMValidationError as e:  # vLLM's refusal of one request at admission
            refused.append(str(e))
    if args.settings is not None:
        settings = json.loads(args.settings)
        prompts = [prompts[i % len(prompts)] for i in range(len(settings))]
        params = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                                 extra_args=None if s is None else {"kvsieve": s}) for s in settings]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    from kvsieve.integrations.vllm.state import current_plugin_state, served_line

    state = current_plugin_state()  # this process's (one process: no engine-core or worker process)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "texts": [o.outputs[0].text for o in outs],
              "prompt_lens": [len(o.prompt_token_ids) for o in outs], "generate_s": wall, "refused": refused,
              "preemptions": _counter(llm, "vllm:num_preemptions"),
              "drafted": _counter(llm, "vllm:spec_decode_num_draft_tokens"),
              "accepted": _counter(llm, "vllm:spec_decode_num_accepted_tokens"),
              # per request and generated token: the top logprobs, {token id: logprob}
              "logprobs": None if args.logprobs is None else [
                  [{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs],
              "native_layers": None if state is None else state.native_layers(),
              "served": None if state is None else served_line(state),
              # each attention layer's CPU kernel ISA (one process: the engine's config is this one's)
              "isas": {name: getattr(layer, "isa", None) for name, layer in
                       llm.llm_engine.vllm_config.compilation_config.static_forward_context.items()},
              "block_size": llm.llm_engine.vllm_config.cache_config.block_size}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f)


def _counter(llm, name: str) -> int:  # noqa: ANN001
    return sum(m.value for m in llm.get_metrics() if m.name == name)


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the guard is required
    main()
