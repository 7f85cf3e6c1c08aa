"""The CI twin of ``benchmarks/vllm_server_load.py`` (vLLM venv, SmolLM2-135M, fp32): vLLM's
OpenAI-compatible server with the plug-in (Quest) on 127.0.0.1 takes a few dozen requests from 32
client threads at once, streaming and not, some cancelled mid-stream, some malformed or over-long,
some with a per-request kvsieve setting the selector cannot honour. Every greedy request's text
equals the same prompt and setting sent alone, each bad setting is refused (HTTP 400) naming its
field, malformed and over-long requests get a 4xx, and the server serves afterwards. Memory is the
benchmark's (>= 1,000 requests, docs/results/vllm_server_load.md); nothing here is timed."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm.platforms", reason="vLLM is not installed (it runs in its own venv, see .ci/run)")

import test_engine  # noqa: E402

from benchmarks.vllm_server_load import KINDS, Request, healthy, judge, plan, references, run_load, send, served  # noqa: E402,E501

model_dir = test_engine.model_dir  # the SmolLM2 checkpoint fixture
NUM_REQUESTS, CLIENTS, MAX_TOKENS = 48, 32, 6


def test_server_under_concurrent_clients(model_dir, tmp_path):
    requests = plan(NUM_REQUESTS, seed=1)
    assert {r.kind for r in requests} == set(KINDS)
    with served(str(model_dir), "quest:budget=64,page_size=16", tmp_path / "server.log") as (port, proc):
        refs = references(port, MAX_TOKENS)
        run = run_load(port, proc.pid, requests, clients=CLIENTS, max_tokens=MAX_TOKENS, sample_every=NUM_REQUESTS,
                       deadline_s=1800)
        assert healthy(port) and proc.poll() is None
        after = send("127.0.0.1", port, Request(-1, "complete", 3, "budget=32"), MAX_TOKENS)
    summary = judge(run, refs)
    assert summary["problems"] == [], "\n".join(summary["problems"])
    assert summary["mismatches"] == 0 and summary["requests"] == NUM_REQUESTS
    for kind, counted in (("bad_setting", "refused_setting"), ("cancel", "cancelled"), ("overlong", "refused_overlong"),
                          ("malformed", "refused_malformed")):
        assert summary[counted] == sum(r.kind == kind for r in requests) > 0, (kind, summary)
    assert summary["served"] == sum(r.kind in ("complete", "stream") for r in requests)
    assert after.status == 200 and after.text == refs[(3, "budget=32")]
    # the settings change the long prompts' text, so a setting lost under load would show as a mismatch
    assert len({refs[(5, s)] for s in ("budget=32", "dense=true")}) == 2, refs
