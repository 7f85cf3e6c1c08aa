"""Paged KV pools, the block allocator and the per-request block ledger.

Pools (one tensor per layer):

* GQA, ``layout="HND"``: ``[num_blocks, 2, num_kv_heads, tokens_per_block, head_dim]``
* GQA, ``layout="NHD"``: ``[num_blocks, 2, tokens_per_block, num_kv_heads, head_dim]``
* MLA latent: ``[num_blocks, tokens_per_block, kv_lora_rank + rope_dim]`` (K and V share it)

Block 0 is a reserved, zero-filled sentinel: padded table entries point at it, so a kernel may
read it without a bounds check. The ledger lives in preallocated int32 numpy arrays indexed by
a *slot* (one per live request) so translations in ``prepare()`` are vectorized gathers.

Two lengths per request: *valid* (committed history, what kernels attend) and *addressable*
(pages reserved for appends not yet accepted, e.g. speculative drafts); valid <= addressable.

Blocks are shared by reference count (:mod:`.block_allocator`): :meth:`KVCacheManager.fork`
gives a beam all its parent's blocks, :meth:`KVCacheManager.reorder` rearranges beams, and a
request added with its ``tokens`` reuses the longest cached prefix of full blocks (each full block
of a request added with tokens is named by a chained hash of its tokens once written,
:meth:`KVCacheManager.cache_full_blocks`). A shared or named block is never written: the ledger
copies it (every layer of the main and auxiliary pools) into a private block before a write
reaches it (copy-on-write in :meth:`KVCacheManager.append_tokens` / ``reserve_tokens``, and
:meth:`KVCacheManager.make_writable` before an eviction compacts the prompt), and ``write`` /
``compact`` refuse a shared block.

Every ledger method checks before it changes anything: a call that raises leaves the ledger and
the allocator as they were. :meth:`KVCacheManager.check_appends` checks a whole step's appends
at once, and :meth:`KVCacheManager.snapshot` / :meth:`KVCacheManager.restore` put the ledger,
the allocator and the pool rows of chosen blocks back after a step failed half-way.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .block_allocator import AllocatorState, BlockAllocator, KVCacheCapacityError
from .kv_pools import PagedPools
from .kv_spec import KVCacheSpec
from .kv_sharing import BlockSharing

__all__ = ["KVCacheSpec", "BlockAllocator", "KVCacheManager", "KVCacheCapacityError", "CacheSnapshot"]


@dataclass(frozen=True)
class CacheSnapshot:
    """What :meth:`KVCacheManager.restore` needs to undo a step: copies of the ledger arrays, the
    slot maps and the allocator (free list, LRU, reference counts, hashes), each slot's token
    record (the list and its length), and the pool rows (main and auxiliary pools, every layer)
    of ``blocks`` as they were."""

    block_table: np.ndarray
    num_blocks_of: np.ndarray
    valid_lens: np.ndarray
    addressable_lens: np.ndarray
    copied_from: np.ndarray
    slot_of: dict[int, int]
    free_slots: list[int]
    allocator: AllocatorState
    tokens: list[tuple[list[int], int] | None]
    hashes: list[tuple[list[bytes], int]]
    blocks: torch.Tensor
    pool_rows: list[torch.Tensor]
    aux_rows: dict[str, list[torch.Tensor]]


def _count(name: str, n: object) -> int:
    """``n`` as a non-negative int; bool, float and negative values raise naming ``name``."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"{name} must be an int >= 0, got {type(n).__name__} {n!r}")
    if n < 0:
        raise ValueError(f"{name} must be an int >= 0, got {n}")
    return int(n)


class KVCacheManager(BlockSharing, PagedPools):
    """Owns the pools, the allocator and the request -> block ledger (sharing: :class:`.kv_sharing.BlockSharing`;
    pool access: :class:`.kv_pools.PagedPools`)."""

    def __init__(self, spec: KVCacheSpec) -> None:
        self.spec = spec
        self.allocator = BlockAllocator(spec.num_blocks)
        held = set(spec.held_layers)
        self.pools = [torch.zeros(spec.pool_shape() if i in held else (0, *spec.pool_shape()[1:]), dtype=spec.dtype,
                                  device=spec.device) for i in range(spec.num_layers)]
        self.aux_pools: dict[str, list[torch.Tensor]] = {}
        r, m = spec.max_requests, spec.max_blocks_per_seq
        self.block_table = np.zeros((r, m), dtype=np.int32)  # padded with the sentinel 0
        self.num_blocks_of = np.zeros(r, dtype=np.int32)
        self.valid_lens = np.zeros(r, dtype=np.int32)
        self.addressable_lens = np.zeros(r, dtype=np.int32)
        self._slot_of: dict[int, int] = {}
        self._free_slots = list(range(r - 1, -1, -1))
        # per slot: the committed token ids of a request added with its tokens (None: not tracked),
        # and the chained hashes of its first full blocks
        self._tokens: list[list[int] | None] = [None] * r
        self._hashes: list[list[bytes]] = [[] for _ in range(r)]
        #: the block a block was copied from on write (0: written fresh); valid for the blocks of live
        #: requests, so per-block state a reader built for the source holds for the copy
        self.copied_from = np.zeros(spec.num_blocks, dtype=np.int32)

    # ---- ledger -------------------------------------------------------------------------
    @property
    def tokens_per_block(self) -> int:
        return self.spec.tokens_per_block

    @property
    def request_ids(self) -> list[int]:
        return list(self._slot_of)

    def slot(self, request_id: int) -> int:
        try:
            return self._slot_of[request_id]
        except KeyError:
            raise KeyError(f"unknown request_id {request_id}; live requests: {sorted(self._slot_of)}") from None

    def slots(self, request_ids: list[int] | np.ndarray) -> np.ndarray:
        return np.fromiter((self.slot(int(r)) for r in request_ids), dtype=np.int32, count=len(request_ids))

    def add_request(self, request_id: int, num_tokens: int = 0, *, tokens: Sequence[int] | None = None) -> int:
        """Register a request and allocate pages for ``num_tokens`` committed tokens; returns its slot.

        With ``tokens`` (the prompt's token ids; ``num_tokens`` must then be 0) the request is
        tracked for prefix caching: it starts holding the longest cached prefix of ``tokens`` in
        whole blocks (at most ``len(tokens) - 1`` positions, so one token is left to compute), shared
        by reference, and :meth:`valid_len` says how many positions that is; append the rest with
        their token ids (``append_tokens(..., tokens=)``)."""
        if isinstance(request_id, bool) or not isinstance(request_id, (int, np.integer)):
            raise TypeError(f"request_id must be an int, got {type(request_id).__name__} {request_id!r}")
        if request_id in self._slot_of:
            raise ValueError(f"request_id {request_id} is already in the cache")
        if tokens is not None and num_tokens:
            raise ValueError("add_request: give tokens (prefix caching) or num_tokens, not both")
        self.check_appends([(request_id, num_tokens)])
        blocks, hashes = self._cached_prefix(tokens) if tokens is not None else ([], [])
        s = self._free_slots.pop()
        self._slot_of[request_id] = s
        self.allocator.incref(blocks)
        n = len(blocks) * self.tokens_per_block
        self.block_table[s, : len(blocks)] = blocks
        self.num_blocks_of[s] = len(blocks)
        self.valid_lens[s] = self.addressable_lens[s] = n
        self._tokens[s] = None if tokens is None else [int(t) for t in tokens[:n]]
        self._hashes[s] = hashes
        if num_tokens:
            self.append_tokens(request_id, num_tokens)
        return s

    def append_tokens(self, request_id: int, n: int, tokens: Sequence[int] | None = None) -> None:
        """Commit ``n`` new tokens (valid and addressable grow together). A request added with its
        tokens takes the ``n`` new token ids in ``tokens``; any other request takes none."""
        n = _count("append_tokens: n", n)
        s = self.slot(request_id)
        if self.addressable_lens[s] != self.valid_lens[s]:
            raise RuntimeError(
                f"request {request_id} has uncommitted reserved tokens; commit_tokens or rewind first"
            )
        self._check_tokens(request_id, s, n, tokens)
        self._grow(s, int(self.valid_lens[s]) + n)
        self.valid_lens[s] += n
        if tokens is not None:
            self._tokens[s].extend(int(t) for t in tokens)

    def reserve_tokens(self, request_id: int, n: int) -> None:
        """Make ``n`` more positions addressable (pages allocated) without committing them."""
        n = _count("reserve_tokens: n", n)
        s = self.slot(request_id)
        if self._tokens[s] is not None:
            raise ValueError(f"reserve_tokens: request {request_id} is tracked for prefix caching, which records "
                             "committed token ids only; speculative reservations are not supported on it")
        self._grow(s, int(self.addressable_lens[s]) + n)

    def commit_tokens(self, request_id: int, n: int) -> None:
        """Accept ``n`` of the reserved positions into the valid history."""
        n = _count("commit_tokens: n", n)
        s = self.slot(request_id)
        if self.valid_lens[s] + n > self.addressable_lens[s]:
            raise ValueError(
                f"commit_tokens: n={n} exceeds the {self.addressable_lens[s] - self.valid_lens[s]} reserved positions"
            )
        self.valid_lens[s] += n

    def rewind(self, request_id: int) -> None:
        """Drop reserved, uncommitted positions and the pages only they used."""
        self.truncate(request_id, int(self.valid_lens[self.slot(request_id)]))

    def truncate(self, request_id: int, new_len: int) -> None:
        """Set valid = addressable = ``new_len`` and drop this request's references to pages past it
        (after compaction)."""
        s = self.slot(request_id)
        if not 0 <= new_len <= self.valid_lens[s]:
            raise ValueError(f"truncate: new_len must be in [0, {self.valid_lens[s]}], got {new_len}")
        keep = -(-new_len // self.tokens_per_block)
        used = int(self.num_blocks_of[s])
        if keep < used:
            self.allocator.release(self._held(s, keep))
            self.block_table[s, keep:used] = 0
        self.num_blocks_of[s] = keep
        self.valid_lens[s] = new_len
        self.addressable_lens[s] = new_len
        if self._tokens[s] is not None:
            self._tokens[s] = self._tokens[s][:new_len]
        self._hashes[s] = self._hashes[s][: new_len // self.tokens_per_block]

    def free_request(self, request_id: int) -> None:
        """Drop the request and its references; blocks nobody else holds are freed (named ones
        stay cached, evictable, until the allocator needs them)."""
        s = self.slot(request_id)
        self.allocator.release(self._held(s))
        self.block_table[s, :] = 0
        self.num_blocks_of[s] = 0
        self.valid_lens[s] = self.addressable_lens[s] = 0
        self._tokens[s], self._hashes[s] = None, []
        del self._slot_of[request_id]
        self._free_slots.append(s)

    def block_ids(self, request_id: int) -> list[int]:
        s = self.slot(request_id)
        return self.block_table[s, : self.num_blocks_of[s]].tolist()

    def valid_len(self, request_id: int) -> int:
        return int(self.valid_lens[self.slot(request_id)])

    def check_appends(self, appends: list[tuple[int, int]]) -> int:
        """Raise, changing nothing, unless every ``(request_id, n)`` of one step can be appended
        together: ids unique, ``n`` ints >= 0, no request with uncommitted reserved tokens, each
        request within ``max_blocks_per_seq``, slots for the new ids and blocks for all of them
        (copies of shared last blocks included). A request id not in the cache counts as new (it
        would be added with ``n`` tokens). Returns the number of blocks the appends would allocate."""
        ids = [rid for rid, _ in appends]
        if len(set(ids)) != len(ids):
            dup = sorted({r for r in ids if ids.count(r) > 1})
            raise ValueError(f"request ids must be unique within a step; repeated: {dup}")
        new_blocks = new_slots = 0
        for rid, n in appends:
            n = _count(f"request {rid}: number of new tokens", n)
            s = self._slot_of.get(rid)
            if s is not None and self.addressable_lens[s] != self.valid_lens[s]:
                raise RuntimeError(f"request {rid} has uncommitted reserved tokens; commit_tokens or rewind first")
            valid = 0 if s is None else int(self.valid_lens[s])
            have = 0 if s is None else int(self.num_blocks_of[s])
            new_slots += s is None
            new_blocks += max(self._blocks_for(valid + n) - have, 0)
            if s is not None and n:
                new_blocks += self._copies_to_write(s, valid)
        if new_slots > len(self._free_slots):
            raise KVCacheCapacityError(
                f"KV cache out of request slots: {new_slots} new requests, {len(self._free_slots)} free of "
                f"max_requests={self.spec.max_requests}")
        if new_blocks > self.allocator.num_free:
            raise KVCacheCapacityError(
                f"KV cache out of blocks: the step needs {new_blocks} new blocks, {self.allocator.num_free} free "
                f"of {self.allocator.num_blocks - 1}")
        return new_blocks

    def _blocks_for(self, num_tokens: int) -> int:
        """Blocks holding ``num_tokens`` positions; raises past ``max_blocks_per_seq``."""
        need = -(-num_tokens // self.tokens_per_block)
        if need > self.spec.max_blocks_per_seq:
            raise ValueError(
                f"a request of {num_tokens} tokens needs {need} blocks > max_blocks_per_seq="
                f"{self.spec.max_blocks_per_seq}"
            )
        return need

    def _grow(self, s: int, new_addressable: int) -> None:
        old = int(self.addressable_lens[s])
        need = self._blocks_for(new_addressable)
        have = int(self.num_blocks_of[s])
        if new_addressable > old:
            self._check_room(max(need - have, 0) + self._copies_to_write(s, old))
            self._make_private(s, old // self.tokens_per_block, have)
        if need > have:
            self.block_table[s, have:need] = self.allocator.allocate(need - have)
            self.copied_from[self.block_table[s, have:need]] = 0
            self.num_blocks_of[s] = need
        self.addressable_lens[s] = max(old, new_addressable)

    # ---- snapshot / restore -------------------------------------------------------------
    def snapshot(self, blocks: list[int] | np.ndarray = ()) -> CacheSnapshot:
        """Copy the ledger, the allocator and, for every layer of the main and auxiliary pools,
        the rows of ``blocks`` (the blocks a step may write)."""
        ids = torch.as_tensor(np.unique(np.asarray(blocks, dtype=np.int64)), device=self.spec.device)
        return CacheSnapshot(
            block_table=self.block_table.copy(), num_blocks_of=self.num_blocks_of.copy(),
            valid_lens=self.valid_lens.copy(), addressable_lens=self.addressable_lens.copy(),
            copied_from=self.copied_from.copy(), slot_of=dict(self._slot_of), free_slots=list(self._free_slots),
            allocator=self.allocator.state(),
            tokens=[None if t is None else (t, len(t)) for t in self._tokens],
            hashes=[(h, len(h)) for h in self._hashes],
            blocks=ids, pool_rows=[p[ids].clone() if len(p) else p for p in self.pools],
            aux_rows={name: [p[ids].clone() if len(p) else p for p in pools] for name, pools in self.aux_pools.items()},
        )

    def restore(self, snap: CacheSnapshot) -> None:
        """Put back what :meth:`snapshot` copied. An auxiliary pool registered after the snapshot
        stays registered and is zero-filled again (as it was created)."""
        self.block_table[:] = snap.block_table
        self.num_blocks_of[:] = snap.num_blocks_of
        self.valid_lens[:] = snap.valid_lens
        self.addressable_lens[:] = snap.addressable_lens
        self.copied_from[:] = snap.copied_from
        self._slot_of = dict(snap.slot_of)
        self._free_slots = list(snap.free_slots)
        self.allocator.set_state(snap.allocator)
        for s, saved in enumerate(snap.tokens):  # token lists only grow in place; other changes replace them
            self._tokens[s] = None if saved is None else saved[0]
            if saved is not None:
                del saved[0][saved[1]:]
        for s, (hashes, n) in enumerate(snap.hashes):
            self._hashes[s] = hashes
            del hashes[n:]
        for pool, rows in zip(self.pools, snap.pool_rows):
            if len(pool):
                pool[snap.blocks] = rows
        for name, pools in self.aux_pools.items():
            saved = snap.aux_rows.get(name)
            for i, pool in enumerate(pools):
                if saved is None:
                    pool.zero_()
                elif len(pool):
                    pool[snap.blocks] = saved[i]
