"""The block allocator: reference-counted block ids, a free list and the prefix-cache index.

Block ids ``1..num_blocks-1`` (block 0 is the reserved sentinel). Every block is in exactly one
state:

* **free**: reference count 0, no hash; on the LIFO free list.
* **held**: reference count >= 1 (requests whose table holds it; a forked beam or a request that
  reused a cached prefix adds one). A held block may carry a hash (it is then *cached*: full, its
  contents fixed, findable by :meth:`BlockAllocator.lookup`).
* **evictable**: reference count 0 but still cached (its hash kept), in least-recently-freed
  order. A prefix hit revives it; the allocator takes evictable blocks only once the free list is
  empty, oldest first, and drops their hash then.

Conservation: free + evictable + held == num_blocks - 1 at all times
(:meth:`BlockAllocator.check`).

A block's hash chains the hashes of the blocks before it (:func:`chain_hash`), so equal hashes
mean equal token prefixes, not only equal blocks.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["BlockAllocator", "KVCacheCapacityError", "AllocatorState", "chain_hash"]


class KVCacheCapacityError(RuntimeError):
    """The cache has no room: out of free blocks or out of request slots (``max_requests``)."""


def chain_hash(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The name of a full block: a 16-byte BLAKE2b digest of the previous block's name (``b""``
    for the first block) and the block's token ids (int64)."""
    return hashlib.blake2b(previous + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


@dataclass(frozen=True)
class AllocatorState:
    """A copy of everything :class:`BlockAllocator` holds (see :meth:`BlockAllocator.state`)."""

    free: list[int]
    evictable: list[int]
    refcount: np.ndarray
    hash_of: dict[int, bytes]


class BlockAllocator:
    """Reference-counted blocks with a LIFO free list and an LRU of cached, unreferenced blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.refcount = np.zeros(num_blocks, dtype=np.int32)
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.named = np.zeros(num_blocks, dtype=bool)  # block has a hash (its contents are fixed)

    @property
    def num_free(self) -> int:
        """Blocks :meth:`allocate` can hand out: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_held(self) -> int:
        """Blocks some request holds (reference count >= 1)."""
        return self.num_blocks - 1 - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks with a hash (held or evictable)."""
        return len(self._hash_of)

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with reference count 1: from the free list, then the oldest evictable
        blocks (their hashes are dropped). Raises :class:`KVCacheCapacityError`, changing nothing."""
        if n > self.num_free:
            raise KVCacheCapacityError(f"KV cache out of blocks: asked for {n}, {self.num_free} free of "
                                       f"{self.num_blocks - 1}")
        taken = self.peek(n)
        k = min(n, len(self._free))
        del self._free[len(self._free) - k:]
        for b in taken[k:]:
            del self._evictable[b]
            del self._block_of[self._hash_of.pop(b)]
        self.named[taken] = False
        self.refcount[taken] = 1
        return taken

    def peek(self, n: int) -> list[int]:
        """The block ids the next ``allocate(n)`` (or several calls summing to ``n``) would hand
        out, in order; nothing is taken."""
        k = min(n, len(self._free))
        taken = self._free[len(self._free) - k:][::-1] if k else []
        if n > k:
            taken += list(self._evictable)[: n - k]
        return taken

    def incref(self, blocks: Sequence[int] | np.ndarray) -> None:
        """One more reference to each of ``blocks`` (held or evictable; an evictable block is
        revived)."""
        ids = self._checked("incref", blocks)
        free = [b for b in ids if self.refcount[b] == 0 and b not in self._evictable]
        if free:
            raise ValueError(f"incref: block {free[0]} is free (neither held nor cached)")
        for b in ids:
            if self.refcount[b] == 0:
                del self._evictable[b]
            self.refcount[b] += 1

    def release(self, blocks: Sequence[int] | np.ndarray) -> None:
        """Drop one reference to each of ``blocks``; a block left with none goes to the evictable
        LRU if cached, to the free list otherwise. Raises, changing nothing, for a block id out of
        range or not held."""
        ids = self._checked("release", blocks)
        counts = np.bincount(np.asarray(ids, dtype=np.int64), minlength=self.num_blocks)
        over = np.flatnonzero(counts > self.refcount)
        if len(over):
            raise ValueError(f"release: block {int(over[0])} has {int(self.refcount[over[0]])} references, "
                             f"asked to drop {int(counts[over[0]])}")
        for b in reversed(ids):
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    # ---- the prefix-cache index ----------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        """The cached block named ``block_hash``, or ``None``."""
        return self._block_of.get(block_hash)

    def hash_of(self, block: int) -> bytes | None:
        return self._hash_of.get(block)

    def register(self, block: int, block_hash: bytes) -> None:
        """Name held block ``block`` ``block_hash`` (its contents are fixed from now on). A hash
        already naming another block is left to that block (the first one stays cached)."""
        if self.refcount[block] < 1:
            raise ValueError(f"register: block {block} is not held")
        if block in self._hash_of or block_hash in self._block_of:
            return
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        self.named[block] = True

    def unregister(self, block: int) -> None:
        """Drop the name of held block ``block`` (before its only holder writes it)."""
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._block_of[h]
        self.named[block] = False

    def forget_names(self) -> None:
        """Drop every block's name: cached blocks nobody holds go to the free list, held ones stay
        held (their contents no longer stand for their tokens, e.g. the attention that computed
        them changed)."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._hash_of.clear()
        self._block_of.clear()
        self.named[:] = False

    # ---- state ---------------------------------------------------------------------------
    def state(self) -> AllocatorState:
        return AllocatorState(list(self._free), list(self._evictable), self.refcount.copy(), dict(self._hash_of))

    def set_state(self, state: AllocatorState) -> None:
        self._free = list(state.free)
        self._evictable = OrderedDict.fromkeys(state.evictable)
        self.refcount[:] = state.refcount
        self._hash_of = dict(state.hash_of)
        self._block_of = {h: b for b, h in self._hash_of.items()}
        self.named[:] = False
        self.named[list(self._hash_of)] = True

    def check(self) -> None:
        """Raise ``AssertionError`` unless the invariants hold: every block in exactly one state,
        free blocks unnamed, evictable blocks named, the two hash maps inverse."""
        free, ev = set(self._free), set(self._evictable)
        held = set(np.flatnonzero(self.refcount > 0).tolist())
        assert len(free) == len(self._free), "a block is twice on the free list"
        assert not (free & ev) and not (free & held) and not (ev & held), "a block is in two states"
        assert free | ev | held == set(range(1, self.num_blocks)), "blocks lost or the sentinel handed out"
        assert not (free & set(self._hash_of)) and ev <= set(self._hash_of), "free named or evictable unnamed"
        assert {h: b for b, h in self._hash_of.items()} == self._block_of, "hash maps disagree"
        assert set(np.flatnonzero(self.named).tolist()) == set(self._hash_of), "named mask disagrees"
        assert int(self.refcount.min()) >= 0 and self.refcount[0] == 0

    def _checked(self, caller: str, blocks: Sequence[int] | np.ndarray) -> list[int]:
        ids = [int(b) for b in blocks]
        if any(b <= 0 or b >= self.num_blocks for b in ids):
            raise ValueError(f"{caller}: block ids must be in [1, {self.num_blocks}), got {ids}")
        return ids
