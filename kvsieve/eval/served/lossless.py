"""The ``acceptance`` task through vLLM (``kvsieve eval --engine vllm``): lossless decoding measured
where it is served, beside the estimate kvsieve's own session gives.

For a run (selector entry, budget, length) and each draft length ``K`` in
the task's ``draft_lengths`` (default :data:`~kvsieve.eval.acceptance.DRAFT_LENGTHS`), one engine: the plug-in with the entry's config at
the run's budget (its process config: per-request settings do not reach a draft pass) and vLLM's
speculative decoding with kvsieve's drafter, ``K`` tokens a step (the launcher's ``<config>@K``
mode, docs/lossless.md). Each prompt is generated alone (greedy, the task's ``max_new_tokens``), and
vLLM's own spec-decode counters read before and after it give the sample's mean accepted length
at ``K`` (tokens per verify pass, ``1 + accepted / drafts``) and, at the longest ``K``, its
acceptance by draft position. Every sample's tokens are compared with vLLM's own attention's on the same prompt
(``tokens_equal_own``: 1 when equal; lossless decoding gives them up to fp32 rounding ties).
Then, :data:`~.protocol.TIMING_REPS` times, one request of the cell's first prompt decodes
:data:`LOSSLESS_DECODE_TOKENS` tokens on vLLM's own attention and on the engine at ``K``: the run's
``lossless_speedup_k{K}`` is the median ratio of decode tokens/s. The score is the accepted length
at ``K = 4`` (the transformers path's), and ``decode_speedup`` the measured speed-up at ``K = 4``
(``decode_tok_s`` / ``own_decode_tok_s`` its medians).

A dense run (and an entry's ``{"dense": true}`` run) is vLLM's own decoding, the baseline (kvsieve's
drafter drafts with a selector only): its
prompts are generated on vLLM's own attention, a score of 1 token per forward pass and a speed-up
of 1 by definition, as for every dense run of the vLLM path.
"""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from ..acceptance import SCORE_K, AcceptanceTask
from ..run_files import Progress, prediction_row
from ..run_plan import RunSpec
from .launch import EngineProcess
from .protocol import PLUGIN_DENSE, TIMING_REPS

__all__ = ["LOSSLESS_DECODE_TOKENS", "lossless_run"]

LOSSLESS_DECODE_TOKENS = 64  # tokens per timed request: several verify passes even at K = 8


def _tokens(engine: EngineProcess, ids: list[int], max_tokens: int) -> tuple[list[int], dict[str, Any]]:
    reply = engine.request({"op": "generate", "prompts": [{"ids": ids, "max_tokens": max_tokens}]})
    return reply["tokens"][0], reply.get("spec", {})


def _rate(engine: EngineProcess, ids: list[int]) -> float:
    return float(engine.request({"op": "time", "ids": ids, "tokens": LOSSLESS_DECODE_TOKENS})["decode_tok_s"])


def lossless_run(start: Callable[[int], EngineProcess], own: EngineProcess, run: RunSpec,
                 prompts: list[tuple[Any, list[int]]], task: AcceptanceTask) -> tuple[Progress, dict[str, Any]]:
    """The run's prediction rows and its extra metrics (module docstring); ``start(k)``: the run's
    lossless engine at ``K = k``, started (closed here); ``own``: vLLM's own attention's engine;
    ``prompts``: the cell's (sample, token ids); ``task``: the run's task (its ``max_new_tokens`` and
    ``draft_lengths``)."""
    t0 = time.perf_counter()
    max_new_tokens = task.max_new_tokens
    references = [_tokens(own, ids, max_new_tokens)[0] for _, ids in prompts]
    rows: list[dict[str, Any]] = [{} for _ in prompts]
    extra: dict[str, Any] = {}
    load0 = os.getloadavg()[0]
    drafts = run.selector is not None and run.budget.label != PLUGIN_DENSE
    lengths = task.draft_lengths if drafts else ()
    for k in lengths:
        engine = start(k)
        try:
            for row, (_, ids), ref in zip(rows, prompts, references):
                tokens, spec = _tokens(engine, ids, max_new_tokens)
                if not spec.get("drafts"):
                    raise RuntimeError(f"lossless decoding at K={k}: vLLM counted no draft for a prompt of "
                                       f"{len(ids)} tokens (is speculation on?)")
                row[f"accepted_length_k{k}"] = 1 + spec["accepted"] / spec["drafts"]
                if k == lengths[-1]:
                    row[f"acceptance_by_position_k{k}"] = "|".join(f"{a / spec['drafts']:.4f}" for a in spec["per_position"])
                row["tokens_equal_own"] = min(row.get("tokens_equal_own", 1), int(tokens == ref))
            base, mine = [], []
            for _ in range(TIMING_REPS):
                base.append(_rate(own, prompts[0][1]))
                mine.append(_rate(engine, prompts[0][1]))
            extra[f"lossless_speedup_k{k}"] = statistics.median(m / b for m, b in zip(mine, base))
            if k == SCORE_K:
                extra.update(decode_tok_s=statistics.median(mine), own_decode_tok_s=statistics.median(base))
        finally:
            engine.close()
    p = Progress(seconds=time.perf_counter() - t0)
    if not drafts:  # vLLM's own decoding: its rate is the run's and the baseline's
        rate = statistics.median(_rate(own, prompts[0][1]) for _ in range(TIMING_REPS))
        extra.update(decode_tok_s=rate, own_decode_tok_s=rate)
    for (sample, ids), row in zip(prompts, rows):
        row["score"] = row.get(f"accepted_length_k{SCORE_K}", 1.0)  # dense: no drafts, one token a pass
        p.rows.append(prediction_row(sample, len(ids), row, []))
        p.fractions.append([])
    extra.update(decode_speedup=extra.get(f"lossless_speedup_k{SCORE_K}", 1.0),
                 load_1m=[round(load0, 2), round(os.getloadavg()[0], 2)])
    return p, extra
