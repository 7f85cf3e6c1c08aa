"""Prefix names survive the loss of the block that first carried them.

Where several held blocks hold the same content (a parent and its fork both filled a block they
shared while it was partly written, each into its own block), every one of them carries the name,
so a lookup finds the content while any of them is held (kvsieve.metadata.block_allocator).

* The four-step pattern of issue 61, driven through the public ``Engine`` API (it failed before
  the ledger named every held copy: 4 positions reused where 12 were cached).
* The allocator's rules for several carriers of a name.
* Random schedules through ``Engine`` checked after every operation against an independent model
  of the cache (:class:`CacheModel`): prefix reuse equals the longest chain of cached names, blocks and
  their sharing are the model's, every request reads its own history, a refusal changes nothing.
"""
from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import torch
from tests.reliability.cache_model import CacheModel, Refused
from tests.reliability.rig import assert_same_state, make_rig, state

from kvsieve.metadata.block_allocator import BlockAllocator, KVCacheCapacityError, chain_hash

VOCAB, MAX_POS = 16, 64


class Tables:
    """Per layer, q/k/v of a token at a position: fixed random tables, so equal tokens at equal
    positions write equal keys whichever request writes them."""

    def __init__(self, rig, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        h, d = rig.hkv, rig.d
        self.t = [[torch.randn(VOCAB, MAX_POS, n, d, generator=g) for n in (h * rig.g, h, h)]
                  for _ in rig.engine.layers]

    def inputs(self, toks: list[int], pos: list[int]):
        ti, pi = torch.tensor(toks, dtype=torch.long), torch.tensor(pos, dtype=torch.long)
        return [tuple(t[ti, pi] for t in layer) for layer in self.t]

    def keys(self, layer: int, toks: list[int]) -> torch.Tensor:
        """K of a history ``toks`` (positions 0, 1, ...)."""
        return self.t[layer][1][torch.tensor(toks, dtype=torch.long), torch.arange(len(toks))]

    def values(self, layer: int, toks: list[int]) -> torch.Tensor:
        return self.t[layer][2][torch.tensor(toks, dtype=torch.long), torch.arange(len(toks))]


def _step(rig, tables, hist: dict[int, list[int]], rids: list[int], toks: list[list[int]], num_contexts: int):
    pos = [p for r, t in zip(rids, toks) for p in range(len(hist[r]), len(hist[r]) + len(t))]
    flat = [x for t in toks for x in t]
    rig.engine.step(rids, [len(t) for t in toks], num_contexts, tables.inputs(flat, pos), tokens=toks)
    for r, t in zip(rids, toks):
        hist[r] += t


@pytest.mark.parametrize("loss", ["evicted", "rewritten"])
def test_a_name_survives_when_the_fork_copy_that_first_carried_it_is_lost(loss: str) -> None:
    """1. request 1 is forked (request 2) while its last block is partly written: they share it;
    2. the child writes first: it gets the copy-on-write copy X, fills it, X is named;
    3. the parent fills its own block with the same tokens;
    4. X is lost: evicted from the LRU under cache pressure, or truncated and rewritten.
    The parent's block still holds that content, so a new request with the parent's history finds
    all 12 of its cached positions (before the fix: 4, the name having left with X)."""
    rig = make_rig(num_blocks=12, max_requests=4, max_blocks_per_seq=8, tpb=4)  # 11 usable blocks of 4
    eng, tables = rig.engine, Tables(rig)
    prompt = [1, 2, 3, 4, 5, 6]
    hist: dict[int, list[int]] = {1: []}
    assert eng.add_request(1, prompt) == 0
    _step(rig, tables, hist, [1], [prompt], 1)
    eng.fork(1, 2)  # step 1: block 1 (positions 4, 5 written) is shared
    hist[2] = list(hist[1])
    _step(rig, tables, hist, [2], [[7, 8]], 0)  # step 2: the child copies block 1 into X and fills it
    x = rig.cache.block_ids(2)[1]
    _step(rig, tables, hist, [1], [[7, 8, 9, 10, 11, 12]], 0)  # step 3: the parent fills its block 1 alike
    assert rig.cache.block_ids(1)[1] != x and hist[1][:8] == hist[2]
    if loss == "evicted":  # step 4: X goes to the LRU, then an unrelated request needs every free block
        eng.free(2)
        need = 4 * (rig.cache.allocator.num_free - 1) + 1
        eng.add_request(3, [15] * need)
        _step(rig, tables, hist | {3: []}, [3], [[15] * need], 1)
        eng.free(3)
    else:  # step 4: the child truncates into X and writes other tokens there
        eng.truncate(2, 6)
        hist[2] = hist[2][:6]
        _step(rig, tables, hist, [2], [[13, 14]], 0)
    rig.cache.allocator.check()
    again = hist[1] + [0]
    assert eng.add_request(4, again) == 12, "the parent's blocks, still held, are found"
    assert rig.cache.block_ids(4) == rig.cache.block_ids(1)
    got = rig.cache.gather(1, 4)[0]
    assert torch.equal(got, tables.keys(1, hist[1]))
    rig.cache.allocator.check()


def test_the_allocator_names_every_held_copy_and_keeps_no_unheld_one() -> None:
    a = BlockAllocator(8)  # 7 usable blocks
    x, y, z = a.allocate(3)
    h, other = chain_hash(b"", [1, 2, 3, 4]), chain_hash(b"", [4, 3, 2, 1])
    a.register(x, h)
    a.register(y, h)
    a.register(y, h)  # its own name again: nothing
    assert a.lookup(h) == x and a.named[[x, y]].all() and a.num_cached == 2
    before = a.state()
    with pytest.raises(ValueError, match="named .* already"):
        a.register(y, other)
    with pytest.raises(ValueError, match="not held"):
        a.register(7, h)
    after = a.state()
    assert after.hash_of == before.hash_of and after.free == before.free and after.evictable == before.evictable
    a.release([x])  # y, held, keeps the name: x is freed nameless
    assert a.lookup(h) == y and not a.named[x] and x in a.state().free and a.num_cached == 1
    a.register(z, h)
    a.release([y])  # z still carries it
    a.release([z])  # the last carrier: evictable
    assert a.lookup(h) == z and a.state().evictable == [z]
    a.check()
    (w,) = a.allocate(1)  # from the free list: z stays cached
    a.register(w, h)  # a held block takes the name: the evictable copy is freed
    assert a.lookup(h) == w and a.state().evictable == [] and a.num_cached == 1 and a.num_free == 6
    a.check()
    (v,) = a.allocate(1)
    a.register(v, h)
    state = a.state()
    a.set_state(state)  # the carriers keep their order
    assert a.lookup(h) == w and a.num_cached == 2
    a.check()


SCRIPTS = [[(7 * i + 3) % VOCAB for i in range(MAX_POS)], [(5 * i * i + 1) % VOCAB for i in range(MAX_POS)],
           [(3 * i + i // 4) % VOCAB for i in range(MAX_POS)]]


def _next_tokens(rng, script: int, start: int, n: int) -> list[int]:
    """Mostly the request's script (so beams and forks write equal blocks), now and then not."""
    return [SCRIPTS[script][start + i] if rng.random() < 0.9 else rng.randrange(VOCAB) for i in range(n)]


def _check(rig, tables, model: CacheModel, probes: list[list[int]], what: str) -> None:
    cache, eng = rig.cache, rig.engine
    cache.allocator.check()
    assert sorted(cache.request_ids) == sorted(model.blocks), what
    same: dict[int, int] = {}  # model block -> engine block: the sharing is the model's, one to one
    refs = np.zeros(cache.spec.num_blocks, dtype=np.int64)
    for rid, blocks in model.blocks.items():
        ids = cache.block_ids(rid)
        np.add.at(refs, ids, 1)
        assert len(ids) == len(blocks), f"{what}: request {rid} holds {len(ids)} blocks, the model {len(blocks)}"
        for b, i in zip(blocks, ids):
            assert same.setdefault(id(b), i) == i, f"{what}: request {rid} shares differently from the model"
        assert cache.valid_len(rid) == len(model.hist[rid]), what
        for layer in (0, len(eng.layers) - 1):  # every request reads its own history
            k, v = cache.gather(layer, rid)
            assert torch.equal(k, tables.keys(layer, model.hist[rid])), f"{what}: request {rid} layer {layer} K"
            assert torch.equal(v, tables.values(layer, model.hist[rid])), f"{what}: request {rid} layer {layer} V"
    assert len(set(same.values())) == len(same), f"{what}: two model blocks are one engine block"
    assert (refs == cache.allocator.refcount).all(), f"{what}: reference counts disagree with the tables"
    assert cache.allocator.num_held == len(same), what
    assert cache.allocator.num_free == model.free + len(model.lru), f"{what}: free + evictable"
    assert cache.allocator.num_cached == sum(map(len, model.carriers.values())), f"{what}: named blocks"
    for tokens in probes + [h + [0] for h in model.hist.values()]:
        want = len(model.reuse(tokens)) * model.p
        assert eng.cached_prefix_len(tokens) == want, f"{what}: prefix reuse of {tokens} is not the model's {want}"


def _both(model_op: Callable[[], object], engine_op: Callable[[], object]) -> object:
    """The model's operation, then the engine's; where the model refuses it (``Refused``, raised
    again), the engine must raise ``KVCacheCapacityError``. Returns what the engine's returned."""
    try:
        model_op()
    except Refused:
        with pytest.raises(KVCacheCapacityError):
            engine_op()
        raise
    return engine_op()


def _random_schedule(seed: int, num_ops: int) -> Counter:
    """Runs one seeded schedule; returns how many operations of each kind ran (``"refused"``: how
    many were refused, ``"duplicate"``: after how many some name had several carriers)."""
    rng = random.Random(seed)
    p, slots = 4, 6
    rig = make_rig(num_blocks=22, max_requests=slots, max_blocks_per_seq=8, tpb=p, max_tokens=64,
                   max_num_requests=slots)
    eng, tables, model = rig.engine, Tables(rig, seed), CacheModel(21, slots, p)
    script: dict[int, int] = {}  # request -> the script its next tokens mostly follow
    probes = [s[:n] for s in SCRIPTS for n in (5, 9, 13, 17, 25)]
    next_id, ran = 0, Counter()

    def step(rids: list[int], toks: list[list[int]], num_contexts: int) -> None:
        hist = {r: model.hist.get(r, []) for r in rids}
        pos = [q for r, t in zip(rids, toks) for q in range(len(hist[r]), len(hist[r]) + len(t))]
        marks = [t if model.tracked.get(r) else None for r, t in zip(rids, toks)]
        inputs = tables.inputs([x for t in toks for x in t], pos)
        _both(lambda: model.step(rids, toks),
              lambda: eng.step(rids, [len(t) for t in toks], num_contexts, inputs, tokens=marks))

    for i in range(num_ops):
        live = sorted(model.blocks)
        room = [r for r in live if len(model.hist[r]) < 8 * p]
        op = rng.choice(["new", "new", "untracked", "decode", "decode", "decode", "chunk", "fork", "fork",
                         "reorder", "truncate", "free"])
        if live and (len(live) == slots or model.free + len(model.lru) < 3) and rng.random() < 0.35:
            op = rng.choice(["free", "truncate"])  # a full cache: mostly make room, sometimes be refused
        if op in ("decode", "chunk", "truncate", "free", "reorder", "fork") and not room:
            op = "new"
        before, what = state(rig.cache), f"seed {seed} op {i} {op}"
        try:
            if op == "new":
                rid, script[next_id] = next_id, rng.randrange(len(SCRIPTS))
                next_id += 1
                prompt = _next_tokens(rng, script[rid], 0, rng.randrange(1, 18))
                got = _both(lambda: model.add(rid, prompt), lambda: eng.add_request(rid, prompt))
                assert got == len(model.hist[rid]), f"{what}: reuse {got} is not the model's {len(model.hist[rid])}"
                added = state(rig.cache)
                try:
                    step([rid], [prompt[got:]], 1)
                except Refused:  # no room for the rest: the request, holding its cached prefix, goes
                    assert_same_state(added, state(rig.cache))
                    model.free_request(rid)
                    eng.free(rid)
                    op = "refused"
            elif op == "untracked":
                script[next_id] = 0
                next_id += 1
                step([next_id - 1], [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 14))]], 1)
            elif op == "decode":  # generation: one token each for some prefilled requests (beams together)
                rids = [r for r in room if model.hist[r] and rng.random() < 0.6] or \
                    [r for r in room if model.hist[r]][:1]
                if rids:
                    step(rids, [_next_tokens(rng, script[r], len(model.hist[r]), 1) for r in rids], 0)
            elif op == "chunk":  # one request's chunk as a context step (one truncated to 0 prefills again)
                rid = rng.choice(room)
                n = rng.randrange(1, 8 * p - len(model.hist[rid]) + 1)
                step([rid], [_next_tokens(rng, script[rid], len(model.hist[rid]), n)], 1)
            elif op == "fork":
                parent, child = rng.choice(room), next_id
                next_id += 1
                _both(lambda: model.fork(parent, child), lambda: eng.fork(parent, child))
                script[child] = script[parent] if rng.random() < 0.8 else rng.randrange(len(SCRIPTS))
            elif op == "reorder":  # beam search keeps some beams twice and drops others
                rids = rng.sample(live, rng.randrange(1, len(live) + 1))
                sources = [rng.randrange(len(rids)) for _ in rids]
                model.reorder(rids, sources)
                eng.reorder(rids, sources)
                old = [script[r] for r in rids]
                script.update((r, old[s]) for r, s in zip(rids, sources))
            elif op == "truncate":  # later steps rewrite the positions, with the same tokens or others
                rid = rng.choice(live)
                length = rng.randrange(0, len(model.hist[rid]) + 1)
                model.truncate(rid, length)
                eng.truncate(rid, length)
                if rng.random() < 0.5:
                    script[rid] = rng.randrange(len(SCRIPTS))
            else:
                rid = rng.choice(live)
                model.free_request(rid)
                eng.free(rid)
        except Refused:
            ran["refused"] += 1
            assert_same_state(before, state(rig.cache))
        else:
            ran[op] += 1
        ran["duplicate"] += any(len(c) > 1 for c in model.carriers.values())
        _check(rig, tables, model, probes, what)
    return ran


@pytest.mark.parametrize("seed", range(8))
def test_prefix_reuse_is_the_longest_chain_of_cached_names_under_random_schedules(seed: int) -> None:
    """A seeded schedule of new requests (tracked or not), decode steps of beams, chunked prefills,
    forks mid-block, beam reordering, truncation (the positions then rewritten, the same or other
    tokens), frees and refusals for want of room, on a cache small enough that the LRU is evicted
    from, through the public Engine API. After every operation: prefix reuse (for every live
    history and fixed probes) is the model's longest chain of cached names; the blocks, their
    sharing, the free, evictable and named counts are the model's; every request reads its own
    history; a refused operation changed nothing."""
    ran = _random_schedule(seed, 150)
    kinds = ("new", "untracked", "decode", "chunk", "fork", "reorder", "truncate", "free", "refused", "duplicate")
    assert all(ran[k] for k in kinds), f"every kind of operation ran, and held blocks shared a name: {dict(ran)}"
