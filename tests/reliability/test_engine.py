"""Engine.step is all-or-nothing: a bad batch is refused before any state changes, and a failure
injected at any point of a step leaves ledger, allocator and pools exactly as before the call."""
from __future__ import annotations

import threading

import pytest
import torch

from kvsieve.metadata.kv_cache import KVCacheCapacityError
from kvsieve.sparse.attention import SparseAttention

from .rig import assert_same_records, assert_same_state, make_rig, records, state

ROCKET = dict(window_size=4, kernel_size=3, prompt_budget=12, page_size=4, topk=2, summary_dtype="float32")


def prefilled(**kw):
    """Rig with request 1 (10 tokens) prefilled: the pools hold data a failed step must not touch."""
    rig = make_rig(**kw)
    rig.engine.step([1], [10], 1, rig.inputs(10, seed=1))
    return rig


# ---- bad batches: refused before anything changes ---------------------------------------------
BAD_BATCHES = [
    pytest.param([2, 2], [3, 3], 2, ValueError, r"unique.*repeated: \[2\]", id="duplicate-id"),
    pytest.param([1, 7], [1, 1], 0, ValueError, "generation request 7 was never prefilled", id="decode-unknown-id"),
    pytest.param([2], [0], 1, ValueError, "seq_lens must be >= 1", id="zero-length"),
    pytest.param([2], [-3], 1, ValueError, "seq_lens must be >= 1.*-3", id="negative-length"),
    pytest.param([2], [2.0], 1, TypeError, "seq_lens entries must be ints.*float", id="float-length"),
    pytest.param([2], [True], 1, TypeError, "seq_lens entries must be ints.*bool", id="bool-length"),
    pytest.param([True], [2], 1, TypeError, "request_ids entries must be ints.*bool", id="bool-id"),
    pytest.param([2], [2], 2, ValueError, r"num_contexts must be in \[0, 1\]", id="num-contexts-too-big"),
    pytest.param([2], [2], -1, ValueError, r"num_contexts must be in \[0, 1\]", id="num-contexts-negative"),
    pytest.param([2, 3], [2], 2, ValueError, "same length", id="length-mismatch"),
    pytest.param([2], [65], 1, ValueError, "max_num_tokens=64", id="too-many-tokens"),
    pytest.param([2, 3, 4, 5, 6], [1] * 5, 5, ValueError, "max_num_requests=4", id="too-many-requests"),
    pytest.param([2, 3], [8, 33], 2, ValueError, "max_blocks_per_seq=8", id="prompt-over-max-blocks"),
    pytest.param([2, 3], [32, 32], 2, KVCacheCapacityError, "out of blocks", id="out-of-blocks"),
]


@pytest.mark.parametrize("rids, lens, nctx, err, match", BAD_BATCHES)
def test_bad_batch_is_refused_before_any_change(rids, lens, nctx, err, match):
    rig = prefilled()
    before = state(rig.cache)
    n = sum(int(x) for x in lens if not isinstance(x, bool) and int(x) > 0)
    with pytest.raises(err, match=match):
        rig.engine.step(rids, lens, nctx, rig.inputs(max(n, 1), seed=2))
    assert_same_state(before, state(rig.cache))


def test_out_of_request_slots_is_refused_and_leaves_no_ghost():
    rig = prefilled(max_requests=2)
    rig.engine.step([2], [3], 1, rig.inputs(3, seed=2))
    before = state(rig.cache)
    for _ in range(3):  # retried: a failed prompt must not hold a slot
        with pytest.raises(KVCacheCapacityError, match="out of request slots.*max_requests=2"):
            rig.engine.step([3], [3], 1, rig.inputs(3, seed=3))
    assert_same_state(before, state(rig.cache))


def test_oversize_prompt_leaves_no_ghost_request():
    rig = make_rig(max_requests=1)
    for _ in range(2):
        with pytest.raises(ValueError, match="needs 9 blocks > max_blocks_per_seq=8"):
            rig.engine.step([5], [33], 1, rig.inputs(33, seed=0))
    assert rig.cache.request_ids == []
    rig.engine.step([6], [4], 1, rig.inputs(4, seed=0))  # the one slot is still free
    assert rig.cache.request_ids == [6]


def test_add_request_with_too_many_tokens_registers_nothing():
    rig = make_rig()
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        rig.cache.add_request(3, 100)
    assert rig.cache.request_ids == [] and len(rig.cache._free_slots) == 4


def test_integer_q_is_refused_naming_the_dtype():
    rig = prefilled()
    before = state(rig.cache)
    q, k, v = rig.inputs(2, seed=2)[0]
    with pytest.raises(TypeError, match="layer 0: q must be a floating-point tensor, got torch.int64"):
        rig.engine.step([1], [2], 0, [(q.long(), k, v)] * 2)
    assert_same_state(before, state(rig.cache))


def test_inputs_with_the_wrong_number_of_rows_are_refused():
    rig = prefilled()
    before = state(rig.cache)
    with pytest.raises(ValueError, match=r"layer 0: q must have num_tokens=2 rows"):
        rig.engine.step([1], [2], 0, rig.inputs(3, seed=2))
    assert_same_state(before, state(rig.cache))


def test_uncommitted_reserved_tokens_are_refused():
    rig = prefilled()
    rig.cache.reserve_tokens(1, 3)
    before = state(rig.cache)
    with pytest.raises(RuntimeError, match="request 1 has uncommitted reserved tokens"):
        rig.engine.step([1], [1], 0, rig.inputs(1, seed=2))
    assert_same_state(before, state(rig.cache))


@pytest.mark.parametrize("n, err", [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_ledger_counts_must_be_non_negative_ints(n, err):
    rig = prefilled()
    before = state(rig.cache)
    with pytest.raises(err, match="append_tokens: n must be an int >= 0"):
        rig.cache.append_tokens(1, n)
    assert_same_state(before, state(rig.cache))


# ---- a failure injected at each point of a step -------------------------------------------------
class Fault(Exception):
    """The injected failure (a class no kvsieve code raises)."""


def _fail_on(obj, name: str, monkeypatch, nth: int = 1) -> None:
    """Make ``obj.name`` raise :class:`Fault` on its ``nth`` call (earlier calls run normally)."""
    original = getattr(obj, name)
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == nth:
            raise Fault(f"{name} call {nth}")
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapped)


BATCH = ([3, 1, 2], [18, 2, 1], 1)  # a new evicting prompt, a two-token decode and a one-token decode
POINTS = [
    ("cache", "add_request", 1), ("cache", "append_tokens", 2), ("metadata", "prepare", 1),
    ("cache", "write", 2), ("selector", "on_append", 2), ("selector", "predict_kv", 1),
    ("selector", "predict_attn", 2), ("backend", "forward", 1), ("cache", "compact", 2),
    ("selector", "on_compacted", 2), ("cache", "truncate", 1),
]


def _rocket_rig():
    rig = make_rig("rocketkv", ROCKET, num_blocks=40)
    rig.engine.step([1, 2], [16, 6], 2, rig.inputs(22, seed=1))  # both evict down to 12 / keep 6
    return rig


@pytest.mark.parametrize("where, name, nth", POINTS, ids=[f"{w}.{n}" for w, n, _ in POINTS])
def test_failure_at_each_point_restores_the_state_and_the_retry_matches_golden(where, name, nth, monkeypatch):
    rig = _rocket_rig()
    before, before_records = state(rig.cache), records(rig.engine)
    obj = {"cache": rig.cache, "metadata": rig.engine.metadata, "selector": rig.engine.layers[0].plan.selector,
           "backend": rig.engine.layers[1].backend}[where]
    _fail_on(obj, name, monkeypatch, nth)
    inputs = rig.inputs(21, seed=5)
    with pytest.raises(Fault):
        rig.engine.step(*BATCH, inputs)
    assert_same_state(before, state(rig.cache))
    assert_same_records(before_records, records(rig.engine))  # new request 3 unseen, its blocks too
    assert rig.engine.metadata.pending_kv_lens == {}
    monkeypatch.undo()
    got = rig.engine.step(*BATCH, inputs)
    golden_rig = _rocket_rig()
    want = golden_rig.engine.step(*BATCH, inputs)
    for g, w in zip(got, want):
        assert torch.equal(g.out, w.out) and torch.equal(g.lse, w.lse)
    assert_same_state(state(golden_rig.cache), state(rig.cache))


def test_begin_step_abort_step_pair_restores_the_state():
    rig = _rocket_rig()
    before = state(rig.cache)
    md = rig.engine.begin_step(*BATCH)
    rig.engine.layers[0].forward(*rig.inputs(21, seed=5)[0], md)
    rig.engine.abort_step()
    assert_same_state(before, state(rig.cache))
    with pytest.raises(RuntimeError, match="abort_step: no step in progress"):
        rig.engine.abort_step()


def test_generation_rows_that_are_not_whole_beam_groups_are_refused_before_any_change():
    rig = prefilled()
    rig.engine.fork(1, 2)
    before = state(rig.cache)
    with pytest.raises(ValueError, match="2 generation rows, not a multiple of beam_width=3"):
        rig.engine.begin_step([1, 2], [1, 1], 0, beam_width=3)
    assert_same_state(before, state(rig.cache))
    md = rig.engine.begin_step([1, 2], [1, 1], 0, beam_width=2)  # one generation request of two beams
    assert md.beam_width == 2 and md.prepared
    rig.engine.abort_step()
    assert_same_state(before, state(rig.cache))


def test_a_step_left_open_is_refused():
    rig = prefilled()
    rig.engine.begin_step([1], [1], 0)
    with pytest.raises(RuntimeError, match="previous step was neither ended nor aborted"):
        rig.engine.begin_step([1], [1], 0)


def test_failure_on_a_fresh_cache_zeroes_the_new_aux_pools(monkeypatch):
    rig = make_rig("rocketkv", ROCKET, num_blocks=40)
    before = state(rig.cache)
    _fail_on(SparseAttention, "_compact", monkeypatch, 1)
    with pytest.raises(Fault):
        rig.engine.step([1], [16], 1, rig.inputs(16, seed=1))
    assert rig.cache.aux_pools  # the page summaries were registered (and written) by the step
    assert_same_state(before, state(rig.cache))


# ---- concurrent engines -------------------------------------------------------------------------
def test_two_engines_in_threads_do_not_interfere():
    steps = [([1, 2], [9, 5], 2), ([1, 2], [1, 2], 0), ([3, 1], [7, 1], 1)]

    def run(rig, seed, out):
        for i, (r, n, c) in enumerate(steps):
            out.extend(rig.engine.step(r, n, c, rig.inputs(sum(n), seed=seed + i)))

    serial = [[], []]
    for j in range(2):
        run(make_rig("oracle_topk", {"budget": 4}), 100 * j, serial[j])
    threaded = [[], []]
    rigs = [make_rig("oracle_topk", {"budget": 4}) for _ in range(2)]
    threads = [threading.Thread(target=run, args=(rigs[j], 100 * j, threaded[j])) for j in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for j in range(2):
        assert len(threaded[j]) == len(serial[j]) == 3 * 2
        for g, w in zip(threaded[j], serial[j]):
            assert torch.equal(g.out, w.out) and torch.equal(g.lse, w.lse)
