"""An independent model of the paged KV cache's ledger, for random-schedule tests: the rules
docs/architecture.md states (KV cache, sharing) written with objects for blocks instead of
arrays of ids, so a test can run a schedule on the engine and on the model and compare."""
from __future__ import annotations


class Refused(Exception):
    """The model says the engine refuses the operation (no slot or no room)."""


class Block:
    """A block of the model: its holders' count and its name (the token prefix it ends, or None)."""

    __slots__ = ("refs", "name")

    def __init__(self) -> None:
        self.refs, self.name = 1, None


class CacheModel:
    """The cache as the ledger's documentation states it, in objects instead of arrays: blocks shared
    by reference and copied before a write into a shared one; every full block of a request added
    with its tokens named by its whole token prefix once its step ends, the held blocks holding one
    prefix each carrying its name; unheld named blocks kept in least-recently-released order (one
    per name, and only names no held block carries) and taken, oldest first, once no free block is
    left. Prefix reuse is the longest chain of whole-block prefixes that carry a name."""

    def __init__(self, usable: int, slots: int, p: int) -> None:
        self.free, self.slots, self.p = usable, slots, p
        self.lru: list[Block] = []  # oldest first
        self.carriers: dict[tuple, list[Block]] = {}  # name -> its blocks, first named first
        self.blocks: dict[int, list[Block]] = {}  # request -> its table
        self.hist: dict[int, list[int]] = {}
        self.tracked: dict[int, bool] = {}

    # blocks
    def _alloc(self, n: int) -> list[Block]:
        k = min(n, self.free)
        self.free -= k
        for b in self.lru[: n - k]:
            self._unname(b)
        del self.lru[: n - k]
        return [Block() for _ in range(n)]

    def _unname(self, b: Block) -> None:
        self.carriers[b.name].remove(b)
        if not self.carriers[b.name]:
            del self.carriers[b.name]
        b.name = None

    def _release(self, blocks: list[Block]) -> None:
        for b in reversed(blocks):  # last block first
            b.refs -= 1
            if b.refs:
                continue
            if b.name is not None and any(c.refs for c in self.carriers[b.name]):
                self._unname(b)
            if b.name is None:
                self.free += 1
            else:
                self.lru.append(b)

    def _name(self, b: Block, name: tuple) -> None:
        if b.name == name:
            return
        assert b.name is None, "a block named twice, differently"
        for c in [c for c in self.carriers.get(name, []) if not c.refs]:  # an unheld copy: freed
            self.lru.remove(c)
            self._unname(c)
            self.free += 1
        b.name = name
        self.carriers.setdefault(name, []).append(b)

    # what the engine is asked
    def reuse(self, tokens: list[int]) -> list[Block]:
        found = []
        for j in range((len(tokens) - 1) // self.p if tokens else 0):
            carriers = self.carriers.get(tuple(tokens[: (j + 1) * self.p]))
            if not carriers:
                break
            found.append(carriers[0])
        return found

    def add(self, rid: int, tokens: list[int]) -> int:
        if len(self.blocks) >= self.slots:
            raise Refused
        found = self.reuse(tokens)
        for b in found:
            if not b.refs:
                self.lru.remove(b)
            b.refs += 1
        self.blocks[rid], self.tracked[rid] = found, True
        self.hist[rid] = list(tokens[: len(found) * self.p])
        return len(found) * self.p

    def _needed(self, rid: int, n: int) -> int:
        have, length = self.blocks.get(rid, []), len(self.hist.get(rid, []))
        copy = int(bool(n) and length % self.p != 0 and have[length // self.p].refs > 1)
        return max(-(-(length + n) // self.p) - len(have), 0) + copy

    def step(self, rids: list[int], toks: list[list[int]]) -> None:
        new = [r for r in rids if r not in self.blocks]
        if len(self.blocks) + len(new) > self.slots or \
                sum(self._needed(r, len(t)) for r, t in zip(rids, toks)) > self.free + len(self.lru):
            raise Refused
        for r in new:
            self.blocks[r], self.hist[r], self.tracked[r] = [], [], False
        for r, t in zip(rids, toks):
            blocks, length = self.blocks[r], len(self.hist[r])
            if t and length % self.p:  # the next write lands in the last block: private first
                last = blocks[-1]
                if last.refs > 1:
                    (blocks[-1],) = self._alloc(1)
                    last.refs -= 1
                elif last.name is not None:
                    self._unname(last)
            blocks += self._alloc(-(-(length + len(t)) // self.p) - len(blocks))
            self.hist[r] += t
        for r in rids:
            if self.tracked[r]:
                h = self.hist[r]
                for j in range(len(h) // self.p):
                    self._name(self.blocks[r][j], tuple(h[: (j + 1) * self.p]))

    def fork(self, parent: int, child: int) -> None:
        if len(self.blocks) >= self.slots:
            raise Refused
        for b in self.blocks[parent]:
            b.refs += 1
        self.blocks[child] = list(self.blocks[parent])
        self.hist[child], self.tracked[child] = list(self.hist[parent]), self.tracked[parent]

    def reorder(self, rids: list[int], sources: list[int]) -> None:
        old = [(self.blocks[r], self.hist[r], self.tracked[r]) for r in rids]
        for r, i in zip(rids, sources):
            self.blocks[r], self.hist[r], self.tracked[r] = list(old[i][0]), list(old[i][1]), old[i][2]
            for b in self.blocks[r]:
                b.refs += 1
        self._release([b for blocks, _, _ in old for b in blocks])

    def truncate(self, rid: int, length: int) -> None:
        keep = -(-length // self.p)
        self._release(self.blocks[rid][keep:])
        del self.blocks[rid][keep:]
        del self.hist[rid][length:]

    def free_request(self, rid: int) -> None:
        self._release(self.blocks.pop(rid))
        del self.hist[rid], self.tracked[rid]
