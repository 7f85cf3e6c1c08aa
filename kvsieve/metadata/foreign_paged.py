"""A *view* of a paged KV cache that another engine owns (vLLM's, for one): kvsieve reads it in
place, never copies it, and never writes K/V into it.

:class:`ForeignPagedKV` offers the read side of :class:`~kvsieve.metadata.KVCacheManager` that
:class:`~kvsieve.metadata.AttentionMetadata`, the selectors and the backends use:

* per layer, K and V as ``[num_blocks, num_kv_heads, tokens_per_block, head_dim]`` *strided views*
  of the owner's tensor (:meth:`bind_layer`; whatever the owner's layout, e.g. vLLM CPU's K stored
  transposed inside ``[num_blocks, Hkv, block_size, 2*D]``, as long as it is expressible by strides);
* a per-step ledger (:meth:`set_batch`): the owner's block table rows and valid lengths of the
  step's requests, copied into small int32 host arrays (the table, not the cache); the request
  ids are the batch rows ``0 .. B-1`` and the slot of row ``i`` is ``i``;
* auxiliary pools ``[num_blocks, ...]`` per layer (:meth:`add_aux_pool`) indexed by the owner's
  *physical* block ids, so selector state (page summaries, index keys) follows a block wherever
  the owner's block table points, whichever request holds it.

Writes, compaction and eviction belong to the owner: :meth:`write`, :meth:`compact` and
:meth:`truncate` raise. The owner's block 0 must be a block no request reads through its valid
length (vLLM reserves it as its null block); padded table entries are 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["ForeignKVSpec", "ForeignPagedKV"]


@dataclass(frozen=True)
class ForeignKVSpec:
    """Geometry of the foreign cache. ``layout`` names the owner's layout (e.g. ``"vllm-cpu"``);
    it is never ``"HND"``/``"NHD"``, so no kvsieve code assumes kvsieve's own pool layout for
    :attr:`ForeignPagedKV.pools`: readers use the strided :meth:`ForeignPagedKV.k_cache` views."""

    num_layers: int
    num_blocks: int
    tokens_per_block: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    layout: str
    max_requests: int
    max_blocks_per_seq: int
    kind: str = "gqa"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "tokens_per_block", "num_kv_heads", "head_dim", "max_requests",
                     "max_blocks_per_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"ForeignKVSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.layout in ("HND", "NHD"):
            raise ValueError("ForeignKVSpec.layout names the owner's layout; 'HND'/'NHD' are kvsieve's own pools")
        if self.kind != "gqa":
            raise ValueError(f"ForeignPagedKV views GQA caches only (K and V per KV head), got kind={self.kind!r}")


class ForeignPagedKV:
    """Read-only paged-KV view: strided K/V views per layer, a per-step ledger, aux pools."""

    def __init__(self, spec: ForeignKVSpec) -> None:
        self.spec = spec
        self.pools: list[torch.Tensor | None] = [None] * spec.num_layers
        self._k: list[torch.Tensor | None] = [None] * spec.num_layers
        self._v: list[torch.Tensor | None] = [None] * spec.num_layers
        self.aux_pools: dict[str, list[torch.Tensor]] = {}
        r, m = spec.max_requests, spec.max_blocks_per_seq
        self.block_table = np.zeros((r, m), dtype=np.int32)
        self.num_blocks_of = np.zeros(r, dtype=np.int32)
        self.valid_lens = np.zeros(r, dtype=np.int32)
        self.addressable_lens = self.valid_lens  # the owner commits before attention: nothing reserved
        self.copied_from = np.zeros(spec.num_blocks, dtype=np.int32)  # kvsieve never copies the owner's blocks
        self._num_rows = 0

    @property
    def tokens_per_block(self) -> int:
        return self.spec.tokens_per_block

    # ---- binding the owner's tensors --------------------------------------------------------
    def bind_layer(self, layer_idx: int, raw: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Point layer ``layer_idx`` at the owner's tensor ``raw`` through ``k``/``v``, views of it
        ``[num_blocks, Hkv, tokens_per_block, head_dim]`` (any strides). Raises if a view is not
        of ``raw``'s storage (a copy would go stale) or has another geometry."""
        s = self.spec
        want = (s.num_blocks, s.num_kv_heads, s.tokens_per_block, s.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != want:
                raise ValueError(f"bind_layer({layer_idx}): {name} must be {list(want)}, got {list(t.shape)}")
            if t.untyped_storage().data_ptr() != raw.untyped_storage().data_ptr():
                raise ValueError(f"bind_layer({layer_idx}): {name} is not a view of the owner's cache tensor")
            if t.dtype != s.dtype or t.device != s.device:
                raise ValueError(f"bind_layer({layer_idx}): {name} is {t.dtype} on {t.device}; the spec says "
                                 f"{s.dtype} on {s.device}")
        self.pools[layer_idx], self._k[layer_idx], self._v[layer_idx] = raw, k, v

    def set_batch(self, block_table: np.ndarray, kv_lens: np.ndarray) -> None:
        """The step's ledger: ``block_table [B, W]`` int32 physical block ids (row ``i`` = request
        ``i``; columns past a request's ``ceil(kv_len / tokens_per_block)`` blocks are not read),
        ``kv_lens [B]`` valid tokens per request, this step's included."""
        b, w = block_table.shape
        s = self.spec
        need = -(-kv_lens.astype(np.int64) // s.tokens_per_block)
        used = int(need.max()) if b else 0
        if b > s.max_requests or used > s.max_blocks_per_seq:
            raise ValueError(f"set_batch: {b} requests of up to {used} blocks exceed max_requests={s.max_requests} "
                             f"or max_blocks_per_seq={s.max_blocks_per_seq}")
        if used > w:
            raise ValueError(f"set_batch: a request of {int(kv_lens.max())} tokens needs {used} blocks, "
                             f"the table has {w} columns")
        self.block_table[:b, :used] = block_table[:, :used]
        self.block_table[:b, used:] = 0
        self.num_blocks_of[:b] = need
        self.valid_lens[:b] = kv_lens
        self._num_rows = b

    # ---- the read side of KVCacheManager ----------------------------------------------------
    def slots(self, request_ids: list[int] | np.ndarray) -> np.ndarray:
        """Request ids are the batch rows of the step; the slot of row ``i`` is ``i``."""
        ids = np.asarray(request_ids, dtype=np.int32)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self._num_rows):
            raise KeyError(f"request ids must be batch rows in [0, {self._num_rows}), got {ids.tolist()}")
        return ids

    def k_cache(self, layer_idx: int) -> torch.Tensor:
        """K of one layer as a ``[num_blocks, Hkv, tokens_per_block, head_dim]`` view of the owner's cache."""
        return self._bound(self._k, layer_idx)

    def v_cache(self, layer_idx: int) -> torch.Tensor:
        """V of one layer, same view as :meth:`k_cache`."""
        return self._bound(self._v, layer_idx)

    def latent_cache(self, layer_idx: int) -> torch.Tensor:
        raise ValueError("latent_cache: a foreign GQA cache has no MLA latent pool")

    def _bound(self, views: list[torch.Tensor | None], layer_idx: int) -> torch.Tensor:
        t = views[layer_idx]
        if t is None:
            raise RuntimeError(f"layer {layer_idx} of the foreign cache was never bound (bind_layer)")
        return t

    def physical(self, slots: np.ndarray, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(block id, offset in block) of request-local ``positions`` of the rows ``slots``."""
        p = self.tokens_per_block
        pos = positions.astype(np.int64)
        if bool((pos >= self.valid_lens[slots]).any()) or bool((pos < 0).any()):
            raise ValueError("physical: a position is outside its request's valid range")
        dev = self.spec.device
        blocks = self.block_table[slots, pos // p].astype(np.int64)
        return torch.from_numpy(blocks).to(dev), torch.from_numpy(pos % p).to(dev)

    def gather(self, layer_idx: int, request_id: int, positions: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous NHD copy of one request's K and V ``[n, Hkv, D]`` (all valid positions by default)."""
        s = int(self.slots([request_id])[0])
        if positions is None:
            positions = torch.arange(int(self.valid_lens[s]))
        blk, off = self.physical(np.full(positions.numel(), s, dtype=np.int32), positions.cpu().numpy())
        return self.k_cache(layer_idx)[blk, :, off], self.v_cache(layer_idx)[blk, :, off]

    def add_aux_pool(self, name: str, entry_shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        """Per-layer ``[num_blocks, *entry_shape]`` state indexed by the owner's physical block ids
        (created zeroed once; the same name and geometry returns the existing pools)."""
        shape = (self.spec.num_blocks, *entry_shape)
        have = self.aux_pools.get(name)
        if have is not None:
            if tuple(have[0].shape) != shape or have[0].dtype != dtype:
                raise ValueError(f"aux pool {name!r} exists with shape {tuple(have[0].shape)} {have[0].dtype}; "
                                 f"asked {shape} {dtype}")
            return have
        pools = [torch.zeros(shape, dtype=dtype, device=self.spec.device) for _ in range(self.spec.num_layers)]
        self.aux_pools[name] = pools
        return pools

    # ---- what the owner does ----------------------------------------------------------------
    def write(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("ForeignPagedKV is a read-only view: the owning engine writes K/V into its cache")

    def compact(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("ForeignPagedKV cannot compact: the owning engine's block manager owns the blocks "
                           "(eviction selectors are refused for foreign caches)")

    def truncate(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("ForeignPagedKV cannot truncate: the owning engine's block manager owns the lengths")
