"""The CI twin of ``benchmarks/vllm_serve.py`` (vLLM venv, SmolLM2-135M, fp32, short prompts): vLLM's
OpenAI-compatible server in the ``own`` mode and with the plug-in's ``dense`` selector runs both
workloads (two users x two turns over one shared text at concurrency 1 and 2; two independent
prompts at concurrency 2), every request streamed. Every metric of every cell is present and finite,
every request is served, ``dense`` answers every request as ``own`` does, and the answer check fails
when one of those real answers is changed. Nothing here is timed (the figures:
docs/results/vllm_serve.md)."""
from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm.platforms", reason="vLLM is not installed (it runs in its own venv, see .ci/run)")

import test_engine  # noqa: E402

from benchmarks.vllm_common import FILLER  # noqa: E402
from benchmarks.vllm_serve import report, run_mode  # noqa: E402
from benchmarks.vllm_serve_report import QUANTILES, check_answers  # noqa: E402
from benchmarks.vllm_serve_workloads import independent_prompts, shared_document  # noqa: E402

model_dir = test_engine.model_dir  # the SmolLM2 checkpoint fixture
ANSWER_TOKENS = (6, 10)


def test_serving_benchmark_metrics_and_answer_check(model_dir, tmp_path):
    document = "Letter 0. " + FILLER * 8
    plan = {("shared", c): shared_document(document, users=2, turns=2, answer_tokens=ANSWER_TOKENS, tag=f"c{c}")
            for c in (1, 2)}
    plan[("independent", 2)] = independent_prompts([f"Letter {i}. " + FILLER * 6 for i in (1, 2)],
                                                   answer_tokens=ANSWER_TOKENS, tag="c2")
    cells, answers = [], {}
    for mode in ("own", "dense"):
        got, answers[mode] = run_mode(mode, model_dir, plan, tmp_path / f"{mode}.log", dtype="float32",
                                      max_model_len=1024, kv_cache_gib=1, timeout_s=600, deadline_s=1200)
        cells += got
    assert [(c.mode, c.workload, c.concurrency) for c in cells] == [
        (m, w, c) for m in ("own", "dense") for w, c in (("shared", 1), ("shared", 2), ("independent", 2))]
    for c in cells:
        m = c.metrics
        assert m.failed == () and m.served == m.requests == len(plan[(c.workload, c.concurrency)][0].questions) \
            * len(plan[(c.workload, c.concurrency)]), c
        for stats in (m.ttft_ms, m.tpot_ms, m.itl_ms):
            assert set(stats) == {f"p{q}" for q in QUANTILES}
            assert all(math.isfinite(v) and v > 0 for v in stats.values()), stats
        assert all(math.isfinite(v) and v > 0 for v in (m.duration_s, m.requests_per_s, m.output_tokens_per_s))
    assert len(answers["own"]) == 2 * 4 + 2 and all(answers["own"].values())
    assert check_answers(answers, ["dense"]) == []
    key = "shared/c2/u1/1"
    planted = {**answers, "dense": {**answers["dense"], key: answers["dense"][key] + " and more"}}
    assert check_answers(planted, ["dense"]) == [f"dense {key}: differs from own at character "
                                                 f"{len(answers['own'][key])}: ' and more' vs ''"]
    text = report(cells, "CPU: test")
    rows = [line for line in text.splitlines() if line.startswith(("| own |", "| dense |"))]
    assert len(rows) == 6 and all(r.endswith("| 1.00 | 1.00 | 1.00 |") for r in rows if r.startswith("| own |"))
