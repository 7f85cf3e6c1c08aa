"""The ``acceptance`` task through vLLM (:mod:`kvsieve.eval.served.lossless`) without vLLM: engines
that answer like the worker does, and the rows, speed-ups and refusals against hand-worked values
(the real engines: tests/vllm/test_eval_served.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvsieve.eval.acceptance import AcceptanceTask
from kvsieve.eval.served import lossless
from kvsieve.eval.tasks.base import Sample


class FakeEngine:
    """Answers ``generate`` with fixed tokens and spec counters and ``time`` with a fixed rate."""

    def __init__(self, tokens, rate, spec=None):
        self.tokens, self.rate, self.spec, self.closed = tokens, rate, spec, False

    def request(self, job):
        if job["op"] == "time":
            return {"decode_tok_s": self.rate}
        reply = {"tokens": [self.tokens(job["prompts"][0]["ids"])]}
        if self.spec is not None:
            reply["spec"] = self.spec
        return reply

    def close(self):
        self.closed = True


def _run():
    return SimpleNamespace(selector=object(), budget=SimpleNamespace(label="b32"))


def _prompts():
    return [(Sample(index=i, prompt="", answers=(), depth=None), [i + 1] * 8) for i in range(2)]


def test_rows_carry_the_measured_accepted_lengths_and_the_run_the_speedups():
    own = FakeEngine(lambda ids: [ids[0], 7, 7], rate=10.0)
    engines = {}

    def fake_engine(k):
        # K drafts a step, accepting 0.5 per position on average: 1 + K/2 tokens per verify pass
        spec = {"drafts": 10.0, "accepted": 5.0 * k, "per_position": [5.0] * k}
        engines[k] = FakeEngine(lambda ids: [ids[0], 7, 8 if ids[0] == 2 and k == 8 else 7], rate=10.0 + k, spec=spec)
        return engines[k]

    p, extra = lossless.lossless_run(fake_engine, own, _run(), _prompts(), AcceptanceTask())
    assert [r["accepted_length_k2"] for r in p.rows] == [2.0, 2.0]
    assert [r["accepted_length_k8"] for r in p.rows] == [5.0, 5.0]
    assert p.rows[0]["score"] == p.rows[0]["accepted_length_k4"] == 3.0
    assert p.rows[0]["acceptance_by_position_k8"] == "|".join(["0.5000"] * 8)
    assert [r["tokens_equal_own"] for r in p.rows] == [1, 0]  # the second prompt differs at K = 8
    assert extra["lossless_speedup_k2"] == pytest.approx(1.2) and extra["decode_speedup"] == pytest.approx(1.4)
    assert extra["decode_tok_s"] == 14.0 and extra["own_decode_tok_s"] == 10.0
    assert all(e.closed for e in engines.values())


def test_the_tasks_draft_lengths_choose_the_engines():
    own = FakeEngine(lambda ids: [ids[0], 7], rate=10.0)
    started = []

    def fake_engine(k):
        started.append(k)
        return FakeEngine(lambda ids: [ids[0], 7], rate=12.0, spec={"drafts": 4.0, "accepted": 4.0, "per_position": [2.0] * k})

    p, extra = lossless.lossless_run(fake_engine, own, _run(), _prompts(),
                                     AcceptanceTask(draft_lengths=[4]))
    assert started == [4]
    assert p.rows[0]["score"] == p.rows[0]["accepted_length_k4"] == 2.0
    assert p.rows[0]["acceptance_by_position_k4"] == "|".join(["0.5000"] * 4)
    assert not any(key.endswith(("_k2", "_k8")) for key in [*p.rows[0], *extra])
    assert extra["decode_speedup"] == pytest.approx(1.2)


def test_an_engine_that_drafts_nothing_fails_the_run():
    own = FakeEngine(lambda ids: [1], rate=10.0)
    made = []

    def fake_engine(k):
        made.append(FakeEngine(lambda ids: [1], rate=10.0, spec={"drafts": 0.0, "accepted": 0.0, "per_position": []}))
        return made[-1]

    with pytest.raises(RuntimeError, match="counted no draft"):
        lossless.lossless_run(fake_engine, own, _run(), _prompts(), AcceptanceTask())
    assert made and made[0].closed  # the engine is closed on the way out


def test_a_dense_run_is_vllm_own_decoding_without_an_engine_of_its_own():
    own = FakeEngine(lambda ids: [ids[0], 7], rate=10.0)
    p, extra = lossless.lossless_run(lambda k: pytest.fail("a dense run starts no lossless engine"), own,
                                     SimpleNamespace(selector=None), _prompts(), AcceptanceTask())
    assert [r["score"] for r in p.rows] == [1.0, 1.0] and extra["decode_speedup"] == 1.0
    assert extra["decode_tok_s"] == extra["own_decode_tok_s"] == 10.0
    assert not any(k.startswith("accepted_length") for r in p.rows for k in r)
