"""Block sharing on the ledger: beams (fork, reorder), copy-on-write, prefix caching and the
sliding-window release. A part of :class:`~kvsieve.metadata.KVCacheManager` (it inherits
:class:`BlockSharing`), split out by job: these methods read and write the manager's ledger arrays
(``block_table``, ``num_blocks_of``, ``valid_lens``, ``addressable_lens``), its slot map, its
per-slot token records and its allocator, as the manager's own methods do.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from .block_allocator import AllocatorState, KVCacheCapacityError, chain_hash

if TYPE_CHECKING:
    from .block_allocator import BlockAllocator
    from .kv_spec import KVCacheSpec

__all__ = ["BlockSharing"]


class BlockSharing:
    """Forks, reordering, copy-on-write, prefix caching and window release over the ledger."""

    allocator: BlockAllocator
    spec: KVCacheSpec
    pools: list[torch.Tensor]
    aux_pools: dict[str, list[torch.Tensor]]
    block_table: np.ndarray
    num_blocks_of: np.ndarray
    valid_lens: np.ndarray
    addressable_lens: np.ndarray
    copied_from: np.ndarray
    _slot_of: dict[int, int]
    _free_slots: list[int]
    _tokens: list[list[int] | None]
    _hashes: list[list[bytes]]

    # ---- sharing: forks, beams, copy-on-write, prefix caching ----------------------------
    def fork(self, parent_id: int, child_id: int) -> None:
        """Start request ``child_id`` as a copy of ``parent_id`` (a beam): it holds every block of
        the parent by reference, the same lengths and token record; the first write into a shared
        block copies it. Raises, changing nothing, for an unknown parent, a taken child id, a
        parent with uncommitted reserved tokens, or no free request slot."""
        p = self.slot(parent_id)
        if isinstance(child_id, bool) or not isinstance(child_id, (int, np.integer)):
            raise TypeError(f"child_id must be an int, got {type(child_id).__name__} {child_id!r}")
        if child_id in self._slot_of:
            raise ValueError(f"fork: request_id {child_id} is already in the cache")
        if self.addressable_lens[p] != self.valid_lens[p]:
            raise RuntimeError(f"fork: request {parent_id} has uncommitted reserved tokens; commit_tokens or rewind first")
        if not self._free_slots:
            raise KVCacheCapacityError(f"KV cache out of request slots: max_requests={self.spec.max_requests}")
        c = self._free_slots.pop()
        self._slot_of[int(child_id)] = c
        self._copy_slot(p, c)
        self.allocator.incref(self._held(c))

    def reorder(self, request_ids: Sequence[int], sources: Sequence[int]) -> None:
        """Beam reordering: request ``request_ids[i]`` takes the state (blocks by reference, lengths,
        token record) that ``request_ids[sources[i]]`` held before the call, like transformers'
        ``Cache.reorder_cache(beam_idx)``. Raises, changing nothing, for unknown or repeated ids, a
        source out of range or a request with uncommitted reserved tokens."""
        slots = self.slots(list(request_ids))
        src = np.asarray(sources, dtype=np.int64)
        if len(set(slots.tolist())) != len(slots):
            raise ValueError(f"reorder: request ids must be unique, got {list(request_ids)}")
        if src.shape != (len(slots),) or (len(src) and (src.min() < 0 or src.max() >= len(slots))):
            raise ValueError(f"reorder: sources must be {len(slots)} indices in [0, {len(slots)}), got {src.tolist()}")
        if bool((self.addressable_lens[slots] != self.valid_lens[slots]).any()):
            raise RuntimeError("reorder: a request has uncommitted reserved tokens; commit_tokens or rewind first")
        old = [(self.block_table[s].copy(), int(self.num_blocks_of[s]), int(self.valid_lens[s]), self._tokens[s],
                list(self._hashes[s])) for s in slots]
        held = np.concatenate([self._held(s) for s in slots] + [np.zeros(0, np.int32)])
        for s, i in zip(slots, src):
            table, nb, n, toks, hashes = old[i]
            self.block_table[s], self.num_blocks_of[s] = table, nb
            self.valid_lens[s] = self.addressable_lens[s] = n
            self._tokens[s], self._hashes[s] = None if toks is None else list(toks), list(hashes)
        self.allocator.incref(np.concatenate([self._held(s) for s in slots] + [np.zeros(0, np.int32)]))
        self.allocator.release(held)

    def make_writable(self, request_id: int, first_block: int = 0) -> None:
        """Make blocks ``first_block..`` of the request private before something rewrites them in
        place (an eviction compacting the prompt): a shared block is copied, a named one only held
        here loses its name. Raises :class:`KVCacheCapacityError`, changing nothing, without room."""
        s = self.slot(request_id)
        have = int(self.num_blocks_of[s])
        self._check_room(self.blocks_to_copy(request_id, first_block))
        self._make_private(s, first_block, have)

    def blocks_to_copy(self, request_id: int, first_block: int = 0) -> int:
        """How many blocks :meth:`make_writable` would allocate (the shared ones from ``first_block``)."""
        s = self.slot(request_id)
        return int((self.allocator.refcount[self._held(s, first_block)] > 1).sum())

    def cache_full_blocks(self, request_ids: Sequence[int]) -> None:
        """Name (hash) the full, written blocks of the tracked requests among ``request_ids`` so that
        later requests can reuse them. Call once the step that wrote them is complete. A block
        holding a prefix another held block carries the name of is named too (either may be lost
        first). Raises, changing nothing, for an unknown request or a block named otherwise."""
        p = self.tokens_per_block
        names: list[tuple[int, list[bytes]]] = []  # per tracked slot, the names of its newly full blocks
        pending: dict[int, bytes] = {}
        for s in dict.fromkeys(self.slot(int(rid)) for rid in request_ids):
            toks, hashes = self._tokens[s], self._hashes[s]
            if toks is None:
                continue
            new: list[bytes] = []
            for j in range(len(hashes), int(self.valid_lens[s]) // p):
                new.append(chain_hash(new[-1] if new else hashes[-1] if hashes else b"", toks[j * p: (j + 1) * p]))
                b = int(self.block_table[s, j])
                if b:  # not released out of a sliding window
                    self.allocator.check_register(b, new[-1])
                    if pending.setdefault(b, new[-1]) != new[-1]:
                        raise ValueError(f"cache_full_blocks: block {b} would be named twice, differently")
            names.append((s, new))
        for s, new in names:
            first = len(self._hashes[s])
            self._hashes[s].extend(new)
            for j, h in enumerate(new, first):
                if self.block_table[s, j]:
                    self.allocator.register(int(self.block_table[s, j]), h)

    def forget_prefixes(self) -> None:
        """End prefix caching for what the cache holds now: every block loses its name (cached
        blocks nobody holds are freed) and no live request is tracked any more (its appends take
        no token ids). For a cache whose contents a later request must not reuse, such as after
        the attention that computed them changed."""
        self.allocator.forget_names()
        for s in range(len(self._tokens)):
            self._tokens[s], self._hashes[s] = None, []

    def adopt_cached(self, old: BlockSharing) -> None:
        """Take over the prefix cache of ``old``, a cache with no live requests of the same geometry
        and at most as many blocks (the cache a session outgrew): its cached blocks keep their ids,
        names and LRU order here, with their contents in every pool and auxiliary pool both caches
        hold. This cache must have no live requests nor cached blocks. Raises, changing nothing,
        otherwise; adopts nothing where this cache keeps per-block state (an auxiliary pool) that
        ``old`` did not."""
        n_old = old.allocator.num_blocks
        if old.request_ids or self.request_ids or self.allocator.num_cached:
            raise ValueError("adopt_cached: both caches must have no live requests, and this one no cached blocks")
        if n_old > self.allocator.num_blocks or old.spec.pool_shape()[1:] != self.spec.pool_shape()[1:] \
                or old.spec.held_layers != self.spec.held_layers or old.spec.dtype != self.spec.dtype:
            raise ValueError(f"adopt_cached: the old cache's geometry ({old.spec.pool_shape()}, layers "
                             f"{old.spec.held_layers}) does not fit this one's ({self.spec.pool_shape()})")
        layer = self.spec.held_layers[0]
        if any(name not in old.aux_pools or old.aux_pools[name][layer].shape[1:] != pools[layer].shape[1:]
               or old.aux_pools[name][layer].dtype != pools[layer].dtype for name, pools in self.aux_pools.items()):
            return  # per-block state the old cache did not keep: its blocks cannot be vouched for here
        state = old.allocator.state()
        cached = state.evictable
        ids = torch.as_tensor(cached, dtype=torch.long)
        for name, pools in [("", self.pools), *self.aux_pools.items()]:
            old_pools = old.aux_pools[name] if name else old.pools
            for i in self.spec.held_layers:
                pools[i][ids] = old_pools[i][ids]
        taken = set(cached)
        free = [b for b in range(self.allocator.num_blocks - 1, 0, -1) if b not in taken]
        self.allocator.set_state(AllocatorState(free, list(cached), np.zeros(self.allocator.num_blocks, np.int32),
                                                {b: state.hash_of[b] for b in cached}))

    def cached_prefix_len(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` a request added with them would find cached now (whole blocks,
        leaving at least one token to compute); changes nothing."""
        return len(self._cached_prefix(tokens)[0]) * self.tokens_per_block

    def _cached_prefix(self, tokens: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """The cached blocks holding the longest prefix of ``tokens`` in whole blocks (leaving at
        least one token uncached) and their hashes."""
        p = self.tokens_per_block
        blocks: list[int] = []
        hashes: list[bytes] = []
        for j in range((len(tokens) - 1) // p if len(tokens) else 0):
            h = chain_hash(hashes[-1] if hashes else b"", tokens[j * p: (j + 1) * p])
            b = self.allocator.lookup(h)
            if b is None:
                break
            blocks.append(b)
            hashes.append(h)
        return blocks, hashes

    def _check_room(self, n: int) -> None:
        if n > self.allocator.num_free:
            raise KVCacheCapacityError(f"KV cache out of blocks: asked for {n}, {self.allocator.num_free} free of "
                                       f"{self.allocator.num_blocks - 1}")

    def _check_private(self, caller: str, blocks: np.ndarray) -> None:
        """Raise naming ``caller`` if any of ``blocks`` is shared (referenced twice) or named
        (cached): such a block is never written."""
        bad = (self.allocator.refcount[blocks] > 1) | self.allocator.named[blocks]
        if bool(bad.any()):
            b = int(np.asarray(blocks).reshape(-1)[np.argmax(bad.reshape(-1))])
            raise RuntimeError(f"{caller}: block {b} is shared or cached ({int(self.allocator.refcount[b])} "
                               "references) and is never written; the ledger copies it on write first")

    def _copies_to_write(self, s: int, first_pos: int) -> int:
        """1 if the block holding ``first_pos`` (a partly filled block the next write lands in) is
        shared and must be copied first, else 0."""
        j = first_pos // self.tokens_per_block
        if first_pos % self.tokens_per_block == 0 or j >= self.num_blocks_of[s]:
            return 0
        return int(self.allocator.refcount[self.block_table[s, j]] > 1)

    def _make_private(self, s: int, first: int, last: int) -> None:
        """Copy-on-write for blocks ``[first, last)`` of slot ``s`` (room was checked)."""
        for j in range(first, last):
            b = int(self.block_table[s, j])
            if b == 0:  # released out of a sliding window
                continue
            if self.allocator.refcount[b] > 1:
                (dst,) = self.allocator.allocate(1)
                for pool in self._held_pools():
                    pool[dst] = pool[b]
                self.allocator.release([b])
                self.block_table[s, j] = dst
                self.copied_from[dst] = b
            else:
                self.allocator.unregister(b)

    def release_before(self, request_id: int, position: int) -> int:
        """Drop the request's references to the blocks wholly before ``position`` (a sliding-window
        cache group: no query reads them again); their table entries become the sentinel 0, the
        lengths and positions do not change. Returns how many blocks were dropped."""
        s = self.slot(request_id)
        end = min(max(int(position), 0) // self.tokens_per_block, int(self.num_blocks_of[s]))
        held = self._held(s, 0, end)
        self.allocator.release(held)
        self.block_table[s, :end] = 0
        return len(held)

    def _held(self, s: int, first: int = 0, last: int | None = None) -> np.ndarray:
        """Block ids in table columns ``[first, last)`` (default: all used) of slot ``s``, without
        the sentinel entries of blocks released out of a sliding window."""
        row = self.block_table[s, first: int(self.num_blocks_of[s]) if last is None else last]
        return row[row != 0]

    def _copy_slot(self, src: int, dst: int) -> None:
        self.block_table[dst] = self.block_table[src]
        self.num_blocks_of[dst] = self.num_blocks_of[src]
        self.valid_lens[dst] = self.valid_lens[src]
        self.addressable_lens[dst] = self.addressable_lens[src]
        self._tokens[dst] = None if self._tokens[src] is None else list(self._tokens[src])
        self._hashes[dst] = list(self._hashes[src])

    def _check_tokens(self, request_id: int, s: int, n: int, tokens: Sequence[int] | None) -> None:
        tracked = self._tokens[s] is not None
        if tracked and (tokens is None or len(tokens) != n):
            got = "none" if tokens is None else len(tokens)
            raise ValueError(f"request {request_id} is tracked for prefix caching: append its {n} new token ids "
                             f"(tokens=), got {got}")
        if not tracked and tokens is not None:
            raise ValueError(f"request {request_id} was added without tokens (not tracked for prefix caching); "
                             "append_tokens takes no token ids for it")
