"""The block allocator: reference-counted block ids, a free list and the prefix-cache index.

Block ids ``1..num_blocks-1`` (block 0 is the reserved sentinel). Every block is in exactly one
state:

* **free**: reference count 0, no name; on the LIFO free list.
* **held**: reference count >= 1 (requests whose table holds it; a forked beam or a request that
  reused a cached prefix adds one). A held block may carry a name (it is then *cached*: full, its
  contents fixed, findable by :meth:`BlockAllocator.lookup`).
* **evictable**: reference count 0 but still named, in least-recently-freed order (a request's
  blocks are released last block first, so a prefix outlives the blocks that extend it). A prefix
  hit revives it; the allocator takes evictable blocks only once the free list is empty, oldest
  first, and drops their name then.

A name (the hash of a block's whole prefix, :func:`chain_hash`) may be carried by several held
blocks: requests that wrote the same prefix each into a block of its own (a parent and its fork
that both filled the block they shared while it was partly written) keep their own blocks, and
each block carries the name, so the name lives while any of them is held. :meth:`lookup` gives the
carrier named first. Unheld copies are not kept: a carrier released while another carrier is held
goes to the free list (nameless), and naming a held block frees an evictable carrier of the same
name. So the LRU holds one block per name at most, and only names no held block carries.

Conservation: free + evictable + held == num_blocks - 1 at all times
(:meth:`BlockAllocator.check`).

A block's name chains the names of the blocks before it (:func:`chain_hash`), so equal names
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
        self._hash_of: dict[int, bytes] = {}  # every named block -> its name, in the order they were named
        self._carriers: dict[bytes, dict[int, None]] = {}  # name -> the blocks carrying it, first named first
        self.named = np.zeros(num_blocks, dtype=bool)  # block has a name (its contents are fixed)

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
        """Blocks with a name (held or evictable; held blocks carrying the same name each count)."""
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
            self._drop_name(b)
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
        """Drop one reference to each of ``blocks``, last one first; a block left with none goes to
        the evictable LRU if it carries a name no held block carries, to the free list otherwise
        (nameless). Raises, changing nothing, for a block id out of range or not held."""
        ids = self._checked("release", blocks)
        counts = np.bincount(np.asarray(ids, dtype=np.int64), minlength=self.num_blocks)
        over = np.flatnonzero(counts > self.refcount)
        if len(over):
            raise ValueError(f"release: block {int(over[0])} has {int(self.refcount[over[0]])} references, "
                             f"asked to drop {int(counts[over[0]])}")
        for b in reversed(ids):
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                h = self._hash_of.get(b)
                if h is not None and len(self._carriers[h]) > 1:  # the others are held: they keep the name
                    self._drop_name(b)
                    h = None
                if h is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    # ---- the prefix-cache index ----------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        """A cached block named ``block_hash`` (the one named first), or ``None``."""
        carriers = self._carriers.get(block_hash)
        return next(iter(carriers)) if carriers else None

    def hash_of(self, block: int) -> bytes | None:
        return self._hash_of.get(block)

    def register(self, block: int, block_hash: bytes) -> None:
        """Name held block ``block`` ``block_hash`` (its contents are fixed from now on). Held
        blocks already named so keep the name too (each holds the same prefix); an evictable one
        is freed, this held block standing for it. Naming a block again with its own name does
        nothing; raises, changing nothing, for a block not held or named otherwise."""
        self.check_register(block, block_hash)
        block = int(block)
        if self._hash_of.get(block) == block_hash:
            return
        for b in [b for b in self._carriers.get(block_hash, ()) if self.refcount[b] == 0]:
            del self._evictable[b]
            self._drop_name(b)
            self._free.append(b)
        self._hash_of[block] = block_hash
        self._carriers.setdefault(block_hash, {})[block] = None
        self.named[block] = True

    def check_register(self, block: int, block_hash: bytes) -> None:
        """Raise, naming the problem, unless :meth:`register` may name ``block`` ``block_hash``:
        the block is held and carries that name or none."""
        (b,) = self._checked("register", [block])
        if self.refcount[b] < 1:
            raise ValueError(f"register: block {b} is not held")
        have = self._hash_of.get(b)
        if have is not None and have != block_hash:
            raise ValueError(f"register: block {b} is named {have.hex()} already, asked to name it {block_hash.hex()}")

    def unregister(self, block: int) -> None:
        """Drop the name of held block ``block`` (before its only holder writes it); the other
        blocks carrying the name keep it."""
        if block in self._hash_of:
            self._drop_name(block)
        self.named[block] = False

    def _drop_name(self, block: int) -> None:
        """Take ``block``'s name off it."""
        self.named[block] = False
        h = self._hash_of.pop(block)
        carriers = self._carriers[h]
        del carriers[block]
        if not carriers:
            del self._carriers[h]

    def forget_names(self) -> None:
        """Drop every block's name: cached blocks nobody holds go to the free list, held ones stay
        held (their contents no longer stand for their tokens, e.g. the attention that computed
        them changed)."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._hash_of.clear()
        self._carriers.clear()
        self.named[:] = False

    # ---- state ---------------------------------------------------------------------------
    def state(self) -> AllocatorState:
        return AllocatorState(list(self._free), list(self._evictable), self.refcount.copy(), dict(self._hash_of))

    def set_state(self, state: AllocatorState) -> None:
        self._free = list(state.free)
        self._evictable = OrderedDict.fromkeys(state.evictable)
        self.refcount[:] = state.refcount
        self._hash_of = dict(state.hash_of)
        self._carriers = {}
        for b, h in self._hash_of.items():  # in naming order, so lookup gives the same carrier
            self._carriers.setdefault(h, {})[b] = None
        self.named[:] = False
        self.named[list(self._hash_of)] = True

    def check(self) -> None:
        """Raise ``AssertionError`` unless the invariants hold: every block in exactly one state,
        free blocks unnamed, evictable blocks named, the name maps agree, and a name carried by an
        evictable block carried by no other block."""
        free, ev = set(self._free), set(self._evictable)
        held = set(np.flatnonzero(self.refcount > 0).tolist())
        assert len(free) == len(self._free), "a block is twice on the free list"
        assert not (free & ev) and not (free & held) and not (ev & held), "a block is in two states"
        assert free | ev | held == set(range(1, self.num_blocks)), "blocks lost or the sentinel handed out"
        assert not (free & set(self._hash_of)) and ev <= set(self._hash_of), "free named or evictable unnamed"
        assert {(b, h) for h, bs in self._carriers.items() for b in bs} == set(self._hash_of.items()), \
            "name maps disagree"
        assert all(bs for bs in self._carriers.values()), "a name with no carrier"
        assert all(len(self._carriers[self._hash_of[b]]) == 1 for b in ev), "an evictable block's name carried twice"
        assert set(np.flatnonzero(self.named).tolist()) == set(self._hash_of), "named mask disagrees"
        assert int(self.refcount.min()) >= 0 and self.refcount[0] == 0

    def _checked(self, caller: str, blocks: Sequence[int] | np.ndarray) -> list[int]:
        ids = [int(b) for b in blocks]
        if any(b <= 0 or b >= self.num_blocks for b in ids):
            raise ValueError(f"{caller}: block ids must be in [1, {self.num_blocks}), got {ids}")
        return ids
