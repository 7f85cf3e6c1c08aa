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
from typing import Literal

import numpy as np
import torch

from .block_allocator import AllocatorState, BlockAllocator, KVCacheCapacityError, chain_hash

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


@dataclass(frozen=True)
class KVCacheSpec:
    """Geometry of the paged cache. ``kind="mla"`` ignores ``num_kv_heads``/``head_dim``."""

    num_layers: int
    num_blocks: int
    tokens_per_block: int
    kind: Literal["gqa", "mla"] = "gqa"
    num_kv_heads: int = 1
    head_dim: int = 64
    kv_lora_rank: int = 0
    rope_dim: int = 0
    layout: Literal["HND", "NHD"] = "HND"
    dtype: torch.dtype = torch.float32
    device: str | torch.device = "cpu"
    max_requests: int = 64
    max_blocks_per_seq: int = 256

    def __post_init__(self) -> None:
        positive = ("num_layers", "num_blocks", "tokens_per_block", "max_requests", "max_blocks_per_seq")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"KVCacheSpec.{name} must be an int >= 1, got {type(value).__name__} {value!r}")
            if value < 1:
                raise ValueError(f"KVCacheSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks < 2:
            raise ValueError("KVCacheSpec.num_blocks must be >= 2 (block 0 is the reserved sentinel)")
        if self.kind not in ("gqa", "mla"):
            raise ValueError(f"KVCacheSpec.kind must be 'gqa' or 'mla', got {self.kind!r}")
        if self.layout not in ("HND", "NHD"):
            raise ValueError(f"KVCacheSpec.layout must be 'HND' or 'NHD', got {self.layout!r}")
        if self.kind == "gqa" and (self.num_kv_heads < 1 or self.head_dim < 1):
            raise ValueError("KVCacheSpec: GQA needs num_kv_heads >= 1 and head_dim >= 1")
        if self.kind == "mla" and self.kv_lora_rank < 1:
            raise ValueError("KVCacheSpec: MLA needs kv_lora_rank >= 1")
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"KVCacheSpec.dtype must be float32, float16 or bfloat16, got {self.dtype}")

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def pool_shape(self) -> tuple[int, ...]:
        n, p = self.num_blocks, self.tokens_per_block
        if self.kind == "mla":
            return (n, p, self.latent_dim)
        if self.layout == "HND":
            return (n, 2, self.num_kv_heads, p, self.head_dim)
        return (n, 2, p, self.num_kv_heads, self.head_dim)


class KVCacheManager:
    """Owns the pools, the allocator and the request -> block ledger."""

    def __init__(self, spec: KVCacheSpec) -> None:
        self.spec = spec
        self.allocator = BlockAllocator(spec.num_blocks)
        self.pools = [torch.zeros(spec.pool_shape(), dtype=spec.dtype, device=spec.device) for _ in range(spec.num_layers)]
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
            self.allocator.release(self.block_table[s, keep:used])
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
        used = int(self.num_blocks_of[s])
        if used:
            self.allocator.release(self.block_table[s, :used])
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
        self.allocator.incref(self.block_table[c, : self.num_blocks_of[c]])

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
        held = np.concatenate([self.block_table[s, : self.num_blocks_of[s]] for s in slots] + [np.zeros(0, np.int32)])
        for s, i in zip(slots, src):
            table, nb, n, toks, hashes = old[i]
            self.block_table[s], self.num_blocks_of[s] = table, nb
            self.valid_lens[s] = self.addressable_lens[s] = n
            self._tokens[s], self._hashes[s] = None if toks is None else list(toks), list(hashes)
        self.allocator.incref(np.concatenate([self.block_table[s, : self.num_blocks_of[s]] for s in slots]
                                             + [np.zeros(0, np.int32)]))
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
        held = self.block_table[s, first_block: self.num_blocks_of[s]]
        return int((self.allocator.refcount[held] > 1).sum())

    def cache_full_blocks(self, request_ids: Sequence[int]) -> None:
        """Name (hash) the full, written blocks of the tracked requests among ``request_ids`` so that
        later requests can reuse them. Call once the step that wrote them is complete."""
        p = self.tokens_per_block
        for rid in request_ids:
            s = self.slot(int(rid))
            toks, hashes = self._tokens[s], self._hashes[s]
            if toks is None:
                continue
            for j in range(len(hashes), int(self.valid_lens[s]) // p):
                hashes.append(chain_hash(hashes[-1] if hashes else b"", toks[j * p: (j + 1) * p]))
                self.allocator.register(int(self.block_table[s, j]), hashes[-1])

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
            if self.allocator.refcount[b] > 1:
                (dst,) = self.allocator.allocate(1)
                for pool in [*self.pools, *(p for pools in self.aux_pools.values() for p in pools)]:
                    pool[dst] = pool[b]
                self.allocator.release([b])
                self.block_table[s, j] = dst
                self.copied_from[dst] = b
            else:
                self.allocator.unregister(b)

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

    # ---- snapshot / restore -------------------------------------------------------------
    def snapshot(self, blocks: list[int] | np.ndarray = ()) -> CacheSnapshot:
        """Copy the ledger, the allocator and, for every layer of the main and auxiliary pools,
        the rows of ``blocks`` (the blocks a step may write)."""
        ids = torch.as_tensor(np.unique(np.asarray(blocks, dtype=np.int64)), device=self.spec.device)
        return CacheSnapshot(
            block_table=self.block_table.copy(), num_blocks_of=self.num_blocks_of.copy(),
            valid_lens=self.valid_lens.copy(), addressable_lens=self.addressable_lens.copy(),
            slot_of=dict(self._slot_of), free_slots=list(self._free_slots), allocator=self.allocator.state(),
            tokens=[None if t is None else (t, len(t)) for t in self._tokens],
            hashes=[(h, len(h)) for h in self._hashes],
            blocks=ids, pool_rows=[p[ids].clone() for p in self.pools],
            aux_rows={name: [p[ids].clone() for p in pools] for name, pools in self.aux_pools.items()},
        )

    def restore(self, snap: CacheSnapshot) -> None:
        """Put back what :meth:`snapshot` copied. An auxiliary pool registered after the snapshot
        stays registered and is zero-filled again (as it was created)."""
        self.block_table[:] = snap.block_table
        self.num_blocks_of[:] = snap.num_blocks_of
        self.valid_lens[:] = snap.valid_lens
        self.addressable_lens[:] = snap.addressable_lens
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
            pool[snap.blocks] = rows
        for name, pools in self.aux_pools.items():
            saved = snap.aux_rows.get(name)
            for i, pool in enumerate(pools):
                if saved is None:
                    pool.zero_()
                else:
                    pool[snap.blocks] = saved[i]

    # ---- pools --------------------------------------------------------------------------
    def k_cache(self, layer_idx: int) -> torch.Tensor:
        """K of one GQA layer as a ``[num_blocks, num_kv_heads, tokens_per_block, head_dim]`` view."""
        return self._kv_view(layer_idx, 0)

    def v_cache(self, layer_idx: int) -> torch.Tensor:
        """V of one GQA layer, same view as :meth:`k_cache`."""
        return self._kv_view(layer_idx, 1)

    def latent_cache(self, layer_idx: int) -> torch.Tensor:
        """The MLA latent pool ``[num_blocks, tokens_per_block, kv_lora_rank + rope_dim]``."""
        if self.spec.kind != "mla":
            raise ValueError("latent_cache: this cache was built with kind='gqa'")
        return self.pools[layer_idx]

    def _kv_view(self, layer_idx: int, which: int) -> torch.Tensor:
        if self.spec.kind != "gqa":
            raise ValueError("k_cache/v_cache: this cache was built with kind='mla'; use latent_cache")
        pool = self.pools[layer_idx][:, which]
        return pool if self.spec.layout == "HND" else pool.transpose(1, 2)

    def add_aux_pool(self, name: str, entry_shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        """Register a per-layer auxiliary pool ``[num_blocks, *entry_shape]`` sharing block ids.

        Row ``b`` of an aux pool describes main-cache block ``b`` (e.g. RocketKV's K min/max
        page summaries, the DSA indexer-K cache). Re-registering the same name and geometry
        returns the existing pools.
        """
        shape = (self.spec.num_blocks, *entry_shape)
        if name in self.aux_pools:
            have = self.aux_pools[name][0]
            if tuple(have.shape) != shape or have.dtype != dtype:
                raise ValueError(
                    f"aux pool {name!r} exists with shape {tuple(have.shape)} {have.dtype}; asked {shape} {dtype}"
                )
            return self.aux_pools[name]
        pools = [torch.zeros(shape, dtype=dtype, device=self.spec.device) for _ in range(self.spec.num_layers)]
        self.aux_pools[name] = pools
        return pools

    def physical(self, slots: np.ndarray, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(block id, offset in block) for request-local ``positions`` of the requests in ``slots``."""
        p = self.tokens_per_block
        pos = positions.astype(np.int64)
        self._check_addressable("physical", slots, pos)
        blocks = self.block_table[slots, pos // p]
        dev = self.spec.device
        return torch.from_numpy(blocks.astype(np.int64)).to(dev), torch.from_numpy(pos % p).to(dev)

    def _check_addressable(self, caller: str, slots: np.ndarray, positions: np.ndarray) -> None:
        """Raise ``ValueError`` naming ``caller`` and the first position outside its request's
        addressable range ``[0, addressable_len)``."""
        limit = self.addressable_lens[slots]
        bad = (positions < 0) | (positions >= limit)
        if bool(bad.any()):
            i = int(np.argmax(bad))
            raise ValueError(f"{caller}: position {int(positions[i])} is outside its request's addressable range "
                             f"[0, {int(limit[i])})")

    def write(self, layer_idx: int, slots: np.ndarray, positions: np.ndarray, k: torch.Tensor,
              v: torch.Tensor | None = None) -> None:
        """Scatter one step's new tokens into the pool.

        ``slots``/``positions``: int arrays ``[n]``; GQA: ``k``/``v`` ``[n, num_kv_heads, head_dim]``;
        MLA: ``k`` is the latent ``[n, kv_lora_rank + rope_dim]`` and ``v`` is ``None``.
        """
        pool = self.pools[layer_idx]
        if self.spec.kind == "gqa" and v is None:
            raise ValueError("write: a GQA cache takes k and v; v is None")
        if len(slots) == 1 and self.spec.kind == "gqa":  # one token (a decode step of one request): basic indexing
            self._check_addressable("write", slots, positions)
            s, p = int(slots[0]), int(positions[0])
            blk, off = int(self.block_table[s, p // self.tokens_per_block]), p % self.tokens_per_block
            if self.allocator.refcount[blk] > 1 or self.allocator.named[blk]:
                self._check_private("write", np.array([blk]))
            if self.spec.layout == "HND":
                pool[blk, 0, :, off], pool[blk, 1, :, off] = k[0], v[0]
            else:
                pool[blk, 0, off], pool[blk, 1, off] = k[0], v[0]
            return
        blk, off = self.physical(slots, positions)
        self._check_private("write", blk.cpu().numpy())
        if self.spec.kind == "mla":
            if v is not None:
                raise ValueError("write: MLA takes the latent as k and v=None")
            pool[blk, off] = k.to(pool.dtype)
        elif self.spec.layout == "HND":
            pool[blk, 0, :, off] = k.to(pool.dtype)
            pool[blk, 1, :, off] = v.to(pool.dtype)
        else:
            pool[blk, 0, off] = k.to(pool.dtype)
            pool[blk, 1, off] = v.to(pool.dtype)

    def gather(self, layer_idx: int, request_id: int, positions: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous NHD copy of one request's K and V (GQA: ``[n, Hkv, D]`` each; MLA: the
        latent ``[n, R+P]`` twice). ``positions`` defaults to all valid positions."""
        s = self.slot(request_id)
        if positions is None:
            positions = torch.arange(int(self.valid_lens[s]))
        blk, off = self.physical(np.full(positions.numel(), s, dtype=np.int32), positions.cpu().numpy())
        if self.spec.kind == "mla":
            lat = self.pools[layer_idx][blk, off]
            return lat, lat
        return self.k_cache(layer_idx)[blk, :, off], self.v_cache(layer_idx)[blk, :, off]

    def compact(self, layer_idx: int, request_id: int, kept: torch.Tensor) -> None:
        """Move kept tokens to the front of the request's pages, per KV head, in place.

        ``kept [num_kv_heads, n_keep]`` (MLA: ``[1, n_keep]``) request-local positions, sorted
        ascending, so each destination ``j <= kept[h, j]``: the gather reads every source before
        the scatter writes. The ledger length is not changed here (other layers still hold the
        full prompt); call :meth:`truncate` once all layers are compacted. The request stops being
        tracked for prefix caching (its positions no longer hold its tokens in order).
        """
        s = self.slot(request_id)
        n_keep = kept.shape[1]
        heads = 1 if self.spec.kind == "mla" else self.spec.num_kv_heads
        if kept.dim() != 2 or kept.shape[0] != heads:
            raise ValueError(f"compact: kept must be [{heads}, n_keep], got {tuple(kept.shape)}")
        if n_keep and (int(kept.min()) < 0 or int(kept.max()) >= self.valid_lens[s]):
            raise ValueError(f"compact: kept positions must be in [0, {self.valid_lens[s]})")
        if n_keep > 1 and bool((kept[:, 1:] <= kept[:, :-1]).any()):
            raise ValueError("compact: kept positions must be strictly ascending per head")
        p = self.tokens_per_block
        self._check_private("compact", self.block_table[s, : -(-n_keep // p)])
        self._tokens[s], self._hashes[s] = None, []  # positions move: the token record no longer names them
        table = torch.from_numpy(self.block_table[s].astype(np.int64)).to(kept.device)
        src = kept.to(torch.int64)
        dst = torch.arange(n_keep, device=kept.device).expand_as(src)
        sb, so, db, do = table[src // p], src % p, table[dst // p], dst % p
        pool = self.pools[layer_idx]
        if self.spec.kind == "mla":
            pool[db[0], do[0]] = pool[sb[0], so[0]]
            return
        for which in (0, 1):
            view = self._kv_view(layer_idx, which)  # [blocks, H, P, D]
            h = torch.arange(heads, device=kept.device).unsqueeze(1).expand_as(src)
            view[db, h, do] = view[sb, h, so]
