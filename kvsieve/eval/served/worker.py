"""One vLLM engine process of ``kvsieve eval --engine vllm`` (runs in vLLM's environment).

``python -m kvsieve.eval.served.worker --model DIR --dtype float32 --max-model-len N
[--speculative-config JSON]``; the kvsieve plug-in is on or off as the environment says
(``KVSIEVE_CONFIG``, set by the launcher, :mod:`.launch`), speculative decoding as the launcher's
mode says (kvsieve's drafter, :meth:`.launch.EngineLaunch.speculative_config`). The
process prints ``READY`` once the engine is built, then answers each JSON line on stdin with one
``REPLY {json}`` line on stdout (anything else vLLM prints goes to stderr or is skipped by the
reader); end of input ends it. Requests:

* ``{"op": "generate", "prompts": [{"ids": [...], "max_tokens": n, "setting": {...} | null,
  "salt": str | null}]}`` -> ``{"tokens": [[...], ...]}``: greedy, ``ignore_eos`` (the answer's stop
  rule is applied by the caller, :func:`.answers.stop_tokens`, as the eval's decoding loop applies
  it), every prompt in one ``generate`` call; ``setting`` goes to ``SamplingParams.extra_args
  ["kvsieve"]`` (per-request settings, docs/vllm.md), ``salt`` to the prompt's ``cache_salt``; under
  speculative decoding the reply adds ``"spec": {"drafts", "accepted", "per_position"}``, vLLM's
  spec-decode counters' increase during the call;
* ``{"op": "time", "ids": [...], "setting": ..., "salt": ..., "tokens": T}`` -> ``{"decode_tok_s",
  "decode_steps", "decode_step_ms"}``: one request, the engine stepped by hand and every step
  timed; decode speed = the tokens after the first / the duration of the steps that made them (a
  speculative step makes 1 to ``K + 1``).

A request vLLM refuses (or that raises) answers ``{"error": "..."}``; the engine goes on.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

__all__ = ["main", "spec_counters", "spec_delta"]

REPLY = "REPLY "


def _prompt(TokensPrompt: Any, ids: list[int], salt: str | None) -> Any:  # noqa: N803 - vLLM's class
    return TokensPrompt(prompt_token_ids=ids, **({"cache_salt": salt} if salt else {}))


def _params(SamplingParams: Any, max_tokens: int, setting: dict[str, Any] | None) -> Any:  # noqa: N803
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          extra_args=None if setting is None else {"kvsieve": setting})


def spec_counters(llm: Any) -> dict[str, Any]:
    """vLLM's spec-decode counters now (drafts, accepted draft tokens, accepted per draft position)."""
    got: dict[str, Any] = {"drafts": 0.0, "accepted": 0.0, "per_position": []}
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            got["drafts"] += float(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            got["accepted"] += float(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            got["per_position"] = [float(v) for v in m.values]
    return got


def _generate(llm: Any, classes: tuple[Any, Any], job: dict[str, Any], speculative: bool) -> dict[str, Any]:
    tokens_prompt, sampling_params = classes
    prompts = [_prompt(tokens_prompt, p["ids"], p.get("salt")) for p in job["prompts"]]
    params = [_params(sampling_params, p["max_tokens"], p.get("setting")) for p in job["prompts"]]
    before = spec_counters(llm) if speculative else None
    outs = llm.generate(prompts, params, use_tqdm=False)
    reply: dict[str, Any] = {"tokens": [list(o.outputs[0].token_ids) for o in outs]}
    if before is not None:
        reply["spec"] = spec_delta(before, spec_counters(llm))
    return reply


def spec_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The increase of :func:`spec_counters` between two readings (a position first counted after
    ``before`` counts from 0)."""
    base = before["per_position"] or [0.0] * len(after["per_position"])
    return {"drafts": after["drafts"] - before["drafts"], "accepted": after["accepted"] - before["accepted"],
            "per_position": [a - b for a, b in zip(after["per_position"], base)]}


def _time(llm: Any, classes: tuple[Any, Any], job: dict[str, Any], n: int) -> dict[str, Any]:
    tokens_prompt, sampling_params = classes
    engine = llm.llm_engine
    engine.add_request(f"time-{n}", _prompt(tokens_prompt, job["ids"], job.get("salt")),
                       _params(sampling_params, job["tokens"], job.get("setting")))
    got, steps, made = 0, [], 0
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        now = max([len(o.outputs[0].token_ids) for o in outs] or [got])
        if got > 0 and now > got:  # a decode step: the request was past its prompt
            steps.append(dt)
            made += now - got
        got = now
    if len(steps) < 2:
        raise RuntimeError(f"only {len(steps)} decode steps were timed (tokens={job['tokens']})")
    return {"decode_tok_s": made / sum(steps), "decode_steps": len(steps), "decode_step_ms": 1e3 * statistics.median(steps)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="checkpoint folder")
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--max-model-len", type=int, required=True)
    ap.add_argument("--max-num-seqs", type=int, required=True)
    ap.add_argument("--speculative-config", type=json.loads, default=None, help="vLLM's speculative_config (JSON)")
    args = ap.parse_args(argv)
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=True,
              max_num_seqs=args.max_num_seqs, seed=0, distributed_executor_backend="uni", enable_prefix_caching=True,
              speculative_config=args.speculative_config, disable_log_stats=args.speculative_config is None)
    classes = (TokensPrompt, SamplingParams)
    print("READY", flush=True)
    for n, line in enumerate(sys.stdin):
        job = json.loads(line)
        try:
            reply = (_generate(llm, classes, job, args.speculative_config is not None) if job["op"] == "generate"
                     else _time(llm, classes, job, n))
        except Exception as err:  # sent back: the caller records it for the run, the engine goes on
            reply = {"error": f"{type(err).__name__}: {err}"}
        print(REPLY + json.dumps(reply), flush=True)


if __name__ == "__main__":  # vLLM may start processes with spawn: the guard is required
    main()
