"""Sharing under random schedules.

* Bit-identical: a random schedule of requests (prompts drawn from a few shared system prompts),
  decode steps, beams (forks) and frees runs on an engine with prefix caching and forks, and again
  with no sharing at all: a request prefills privately, in a step of its own, the prefix the
  sharing run found cached, then the rest as the sharing run does; a fork re-prefills its parent's
  history. Every step of the schedule gives bit-identical outputs in the two runs. Each layer's q/k/v are
  a fixed function of (token, position), so both runs cache the same values.
* Invariants after every ledger operation of a random schedule: the allocator conserves blocks,
  a block's reference count is the number of table entries holding it (no block freed while
  referenced), a named (cached) block's contents never change, and an operation that raises leaves
  the ledger, the allocator and every pool exactly as before.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from tests.reliability.rig import assert_same_state, make_rig, state

from kvsieve.metadata.block_allocator import KVCacheCapacityError

VOCAB, MAX_POS = 12, 96
SYSTEM = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9]]


class Tables:
    """Per layer, q/k/v of a token at a position: fixed random tables."""

    def __init__(self, rig, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        h, d = rig.hkv, rig.d
        self.t = [[torch.randn(VOCAB, MAX_POS, n, d, generator=g) for n in (h * rig.g, h, h)] for _ in rig.engine.layers]

    def inputs(self, toks: list[int], pos: list[int]):
        ti, pi = torch.tensor(toks), torch.tensor(pos)
        return [tuple(t[ti, pi] for t in layer) for layer in self.t]


def _run(schedule, share: bool, selector: str | None, params: dict, splits: list[int] | None = None
         ) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Outputs of every step of ``schedule``, and how many prompt tokens each new request found
    cached. Without sharing, ``splits`` (those counts of the sharing run) make the same schedule: the
    request prefills that many tokens in a step of its own first, privately."""
    rig = make_rig(selector, params, num_blocks=160, max_requests=8, max_blocks_per_seq=24, max_tokens=256,
                   max_num_requests=8, tpb=4, backend="torch")
    tables, eng = Tables(rig, 0), rig.engine
    hist: dict[int, list[int]] = {}
    outs = []

    def step(rids, toks, num_ctx, tracked):
        lens = [len(t) for t in toks]
        pos = [p for r, t in zip(rids, toks) for p in range(len(hist[r]), len(hist[r]) + len(t))]
        flat = [x for t in toks for x in t]
        for r, t in zip(rids, toks):
            hist[r] += t
        return eng.step(rids, lens, num_ctx, tables.inputs(flat, pos),
                        tokens=[t if tracked.get(r) else None for r, t in zip(rids, toks)])

    tracked: dict[int, bool] = {}
    found: list[int] = []
    for op in schedule:
        if op[0] == "new":
            _, rid, prompt = op
            hist[rid], tracked[rid] = [], share
            if share:
                got = eng.add_request(rid, prompt)
                hist[rid] = prompt[:got]
            else:
                got = splits[len(found)]
                if got:
                    step([rid], [prompt[:got]], 1, tracked)
            found.append(got)
            res = step([rid], [prompt[got:]], 1, tracked)
            outs.append([o.out[-1] for o in res])  # the prompt's last row (the rows computed differ)
        elif op[0] == "decode":
            _, rids, toks = op
            outs.append([o.out for o in step(rids, [[t] for t in toks], 0, tracked)])
        elif op[0] == "fork":
            _, parent, child = op
            if share:
                eng.fork(parent, child)
                hist[child], tracked[child] = list(hist[parent]), tracked[parent]
            else:
                hist[child], tracked[child] = [], False
                step([child], [list(hist[parent])], 1, tracked)
        else:
            eng.free(op[1])
            del hist[op[1]]
        rig.cache.allocator.check()
    return outs, found


def _schedule(seed: int) -> list[tuple]:
    rng = random.Random(seed)
    live, ops, next_id = {}, [], 0
    for _ in range(28):
        kind = rng.choice(["new", "new", "decode", "decode", "decode", "fork", "free"])
        if kind == "new" and len(live) < 5:
            prompt = rng.choice(SYSTEM) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 7))]
            ops.append(("new", next_id, prompt))
            live[next_id] = len(prompt)
            next_id += 1
        elif kind == "decode" and live:
            rids = [r for r in live if live[r] < 60 and rng.random() < 0.7] or [next(iter(live))]
            ops.append(("decode", rids, [rng.randrange(VOCAB) for _ in rids]))
            for r in rids:
                live[r] += 1
        elif kind == "fork" and live and len(live) < 5:
            parent = rng.choice(sorted(live))
            ops.append(("fork", parent, next_id))
            live[next_id] = live[parent]
            next_id += 1
        elif kind == "free" and len(live) > 1:
            rid = rng.choice(sorted(live))
            ops.append(("free", rid))
            del live[rid]
    return ops


@pytest.mark.parametrize("selector,params", [
    (None, {}),
    ("quest", {"budget": 8, "page_size": 2, "summary_dtype": "float32"}),  # page summaries: an aux pool
    ("oracle_topk", {"budget": 6}),
])
@pytest.mark.parametrize("seed", [0, 6])
def test_sharing_is_bit_identical_to_no_sharing(selector, params, seed) -> None:
    schedule = _schedule(seed)
    assert any(op[0] == "fork" for op in schedule) and sum(op[0] == "new" for op in schedule) >= 3
    shared, found = _run(schedule, True, selector, params)
    private, _ = _run(schedule, False, selector, params, splits=found)
    assert sum(found) >= 8, "some request reused a cached prefix"
    assert len(shared) == len(private)
    for i, (a, b) in enumerate(zip(shared, private)):
        for layer, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"step {i} layer {layer}: {schedule[i] if i < len(schedule) else ''}"


def _references(cache) -> np.ndarray:
    counts = np.zeros(cache.spec.num_blocks, dtype=np.int64)
    for rid in cache.request_ids:
        np.add.at(counts, cache.block_ids(rid), 1)
    return counts


@pytest.mark.parametrize("seed", range(4))
def test_ledger_invariants_and_atomicity_under_random_operations(seed: int) -> None:
    rng = random.Random(seed)
    rig = make_rig(num_blocks=20, max_requests=5, max_blocks_per_seq=8, tpb=4)
    cache = rig.cache
    named: dict[tuple[int, bytes], list[torch.Tensor]] = {}  # (block, name) -> its contents when named
    failures = 0
    for i in range(300):
        live = cache.request_ids
        rid = rng.choice(live) if live and rng.random() < 0.9 else rng.randrange(12)
        prompt = rng.choice(SYSTEM)[: rng.randrange(2, 14)] + [rng.randrange(VOCAB)]
        before = state(cache)
        before_alloc = cache.allocator.state()
        op = rng.choice(["add", "add_tokens", "append", "fork", "reorder", "truncate", "free", "writable", "write"])
        try:
            if op == "add":
                cache.add_request(rid, rng.randrange(0, 40))
            elif op == "add_tokens":
                cache.add_request(rid, tokens=prompt)
            elif op == "append":
                n = rng.randrange(0, 12)
                toks = [rng.randrange(VOCAB) for _ in range(n)]
                tracked = rid in live and cache._tokens[cache.slot(rid)] is not None
                cache.append_tokens(rid, n, toks if tracked or rng.random() < 0.1 else None)
                if tracked:
                    s = cache.slot(rid)
                    n_all = cache.valid_len(rid)
                    k = (torch.tensor(toks) * 100.0 + torch.arange(n_all - n, n_all))[:, None, None].expand(
                        n, rig.hkv, rig.d)  # a function of (token, position), as a model's keys are
                    cache.write(0, np.full(n, s, dtype=np.int32), np.arange(n_all - n, n_all), k, k)
                    cache.cache_full_blocks([rid])
            elif op == "fork":
                cache.fork(rid, rng.randrange(12))
            elif op == "reorder":
                cache.reorder(live, [rng.randrange(len(live)) for _ in live])
            elif op == "truncate":
                cache.truncate(rid, rng.randrange(0, cache.valid_len(rid) + 2))
            elif op == "free":
                cache.free_request(rid)
            elif op == "writable":
                cache.make_writable(rid, rng.randrange(0, 3))
            else:  # a write at an arbitrary position: refused on a shared or named block
                n = cache.valid_len(rid)
                pos = np.array([rng.randrange(0, max(n, 1))])
                cache.write(0, np.full(1, cache.slot(rid), dtype=np.int32), pos, torch.ones(1, rig.hkv, rig.d),
                            torch.ones(1, rig.hkv, rig.d))
        except (ValueError, RuntimeError, KeyError, KVCacheCapacityError, TypeError):
            failures += 1
            assert_same_state(before, state(cache))
            after_alloc = cache.allocator.state()
            assert after_alloc.refcount.tolist() == before_alloc.refcount.tolist()
            assert after_alloc.evictable == before_alloc.evictable and after_alloc.hash_of == before_alloc.hash_of
        cache.allocator.check()
        refs = _references(cache)
        held = cache.allocator.refcount
        assert (refs == held).all(), f"op {i} ({op}): reference counts disagree with the tables"
        for b, h in list(named):
            if cache.allocator.hash_of(b) != h:
                del named[b, h]
            else:
                assert all(torch.equal(p[b], c) for p, c in zip(cache.pools, named[b, h])), f"named block {b} written"
        for b in np.flatnonzero(cache.allocator.named).tolist():
            named.setdefault((b, cache.allocator.hash_of(b)), [p[b].clone() for p in cache.pools])
    assert failures > 20 and cache.allocator.num_cached > 0


@pytest.mark.parametrize("selector,params", [
    (None, {}), ("snapkv", {"window_size": 3, "kernel_size": 3, "prompt_budget": 8}),
    ("quest", {"budget": 8, "page_size": 2, "summary_dtype": "float32"}),
])
def test_a_step_failing_midway_leaves_the_sharing_state_as_before(selector, params) -> None:
    """A step holding a fork (its partial last block copied on write), a request reusing a cached
    prefix (made private first when a layer evicts) and a new request fails in its last layer:
    blocks, reference counts, names, token records and every pool are back as before."""
    rig = make_rig(selector, params, num_blocks=40, max_requests=6, max_blocks_per_seq=10, max_tokens=96,
                   max_num_requests=6, backend="torch")
    eng, prompt = rig.engine, SYSTEM[1] + [1, 2, 3]
    plans = [layer.plan for layer in eng.layers]
    for layer in eng.layers:  # a dense prefill names the prompt's blocks (an eviction would renumber them)
        layer.plan = None
    eng.add_request(1, prompt)
    eng.step([1], [len(prompt)], 1, rig.inputs(len(prompt), seed=0), tokens=[prompt])
    for layer, plan in zip(eng.layers, plans):
        layer.plan = plan
    eng.fork(1, 2)
    got = eng.add_request(3, prompt[:-1] + [7, 7])
    assert got == 12
    before = state(rig.cache)

    def boom(*args, **kwargs):
        raise RuntimeError("layer failed")

    eng.layers[-1].forward = boom
    new = prompt[:-1] + [7, 7]
    n3 = len(new) - got
    # snapkv refuses the chunked prefill of request 3 in layer 0, after its blocks were made private
    with pytest.raises((RuntimeError, ValueError), match="layer failed|chunked prefill is not supported"):
        eng.step([3, 4, 2], [n3, 5, 1], 2, rig.inputs(n3 + 5 + 1, seed=1), tokens=[new[got:], None, [9]])
    assert_same_state(before, state(rig.cache))
    rig.cache.allocator.check()
