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

Every ledger method checks before it changes anything: a call that raises leaves the ledger and
the allocator as they were. :meth:`KVCacheManager.check_appends` checks a whole step's appends
at once, and :meth:`KVCacheManager.snapshot` / :meth:`KVCacheManager.restore` put the ledger,
the allocator and the pool rows of chosen blocks back after a step failed half-way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

__all__ = ["KVCacheSpec", "BlockAllocator", "KVCacheManager", "KVCacheCapacityError", "CacheSnapshot"]


class KVCacheCapacityError(RuntimeError):
    """The cache has no room: out of free blocks or out of request slots (``max_requests``)."""


@dataclass(frozen=True)
class CacheSnapshot:
    """What :meth:`KVCacheManager.restore` needs to undo a step: copies of the ledger arrays, the
    slot maps and the allocator's free list, and the pool rows (main and auxiliary pools, every
    layer) of ``blocks`` as they were."""

    block_table: np.ndarray
    num_blocks_of: np.ndarray
    valid_lens: np.ndarray
    addressable_lens: np.ndarray
    slot_of: dict[int, int]
    free_slots: list[int]
    free_blocks: list[int]
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


class BlockAllocator:
    """A LIFO free list of block ids ``1..num_blocks-1``; block 0 is never handed out."""

    def __init__(self, num_blocks: int) -> None:
        self._free = list(range(num_blocks - 1, 0, -1))
        self.num_blocks = num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVCacheCapacityError(f"KV cache out of blocks: asked for {n}, {len(self._free)} free of {self.num_blocks - 1}")
        taken = self.peek(n)
        del self._free[len(self._free) - n:]
        return taken

    def peek(self, n: int) -> list[int]:
        """The block ids the next ``allocate(n)`` would hand out (nothing is taken)."""
        return self._free[len(self._free) - n:][::-1] if n else []

    def release(self, blocks: list[int] | np.ndarray) -> None:
        ids = [int(b) for b in blocks]
        if any(b <= 0 or b >= self.num_blocks for b in ids):
            raise ValueError(f"release: block ids must be in [1, {self.num_blocks}), got {ids}")
        self._free.extend(reversed(ids))


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

    def add_request(self, request_id: int, num_tokens: int = 0) -> int:
        """Register a request and allocate pages for ``num_tokens`` committed tokens."""
        if isinstance(request_id, bool) or not isinstance(request_id, (int, np.integer)):
            raise TypeError(f"request_id must be an int, got {type(request_id).__name__} {request_id!r}")
        if request_id in self._slot_of:
            raise ValueError(f"request_id {request_id} is already in the cache")
        self.check_appends([(request_id, num_tokens)])
        s = self._free_slots.pop()
        self._slot_of[request_id] = s
        self.num_blocks_of[s] = 0
        self.valid_lens[s] = 0
        self.addressable_lens[s] = 0
        if num_tokens:
            self.append_tokens(request_id, num_tokens)
        return s

    def append_tokens(self, request_id: int, n: int) -> None:
        """Commit ``n`` new tokens (valid and addressable grow together)."""
        n = _count("append_tokens: n", n)
        s = self.slot(request_id)
        if self.addressable_lens[s] != self.valid_lens[s]:
            raise RuntimeError(
                f"request {request_id} has uncommitted reserved tokens; commit_tokens or rewind first"
            )
        self._grow(s, int(self.valid_lens[s]) + n)
        self.valid_lens[s] += n

    def reserve_tokens(self, request_id: int, n: int) -> None:
        """Make ``n`` more positions addressable (pages allocated) without committing them."""
        n = _count("reserve_tokens: n", n)
        s = self.slot(request_id)
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
        """Set valid = addressable = ``new_len`` and free pages past it (after compaction)."""
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

    def free_request(self, request_id: int) -> None:
        s = self.slot(request_id)
        used = int(self.num_blocks_of[s])
        if used:
            self.allocator.release(self.block_table[s, :used])
        self.block_table[s, :] = 0
        self.num_blocks_of[s] = 0
        self.valid_lens[s] = self.addressable_lens[s] = 0
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
        request within ``max_blocks_per_seq``, slots for the new ids and blocks for all of them.
        A request id not in the cache counts as new (it would be added with ``n`` tokens).
        Returns the number of blocks the appends would allocate."""
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
        need = self._blocks_for(new_addressable)
        have = int(self.num_blocks_of[s])
        if need > have:
            self.block_table[s, have:need] = self.allocator.allocate(need - have)
            self.num_blocks_of[s] = need
        self.addressable_lens[s] = max(int(self.addressable_lens[s]), new_addressable)

    # ---- snapshot / restore -------------------------------------------------------------
    def snapshot(self, blocks: list[int] | np.ndarray = ()) -> CacheSnapshot:
        """Copy the ledger, the allocator and, for every layer of the main and auxiliary pools,
        the rows of ``blocks`` (the blocks a step may write)."""
        ids = torch.as_tensor(np.unique(np.asarray(blocks, dtype=np.int64)), device=self.spec.device)
        return CacheSnapshot(
            block_table=self.block_table.copy(), num_blocks_of=self.num_blocks_of.copy(),
            valid_lens=self.valid_lens.copy(), addressable_lens=self.addressable_lens.copy(),
            slot_of=dict(self._slot_of), free_slots=list(self._free_slots), free_blocks=list(self.allocator._free),
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
        self.allocator._free = list(snap.free_blocks)
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
            if self.spec.layout == "HND":
                pool[blk, 0, :, off], pool[blk, 1, :, off] = k[0], v[0]
            else:
                pool[blk, 0, off], pool[blk, 1, off] = k[0], v[0]
            return
        blk, off = self.physical(slots, positions)
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
        full prompt); call :meth:`truncate` once all layers are compacted.
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
