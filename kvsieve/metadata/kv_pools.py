"""Pool access for :class:`~kvsieve.metadata.KVCacheManager` (it inherits :class:`PagedPools`),
split out by job: per-layer K/V (or MLA latent) views, auxiliary pools, and the reads and writes
that go through the ledger's block table (``physical``, ``write``, ``gather``, ``compact``).
"""
from __future__ import annotations

import numpy as np
import torch

from .kv_spec import KVCacheSpec

__all__ = ["PagedPools"]


class PagedPools:
    """The pools of the layers a cache holds and the block-table reads and writes into them."""

    spec: KVCacheSpec
    pools: list[torch.Tensor]
    aux_pools: dict[str, list[torch.Tensor]]
    block_table: np.ndarray
    valid_lens: np.ndarray
    addressable_lens: np.ndarray
    _tokens: list[list[int] | None]
    _hashes: list[list[bytes]]

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
        return self._pool(layer_idx)

    def _pool(self, layer_idx: int) -> torch.Tensor:
        """The pool of ``layer_idx``; raises naming it when this cache does not hold that layer."""
        if self.spec.layers is not None and layer_idx not in self.spec.layers:
            raise ValueError(f"layer {layer_idx} is not in this KV cache group (layers {self.spec.held_layers})")
        return self.pools[layer_idx]

    def _held_pools(self) -> list[torch.Tensor]:
        """Every held layer's main and auxiliary pools."""
        return [self.pools[i] for i in self.spec.held_layers] + [
            pools[i] for pools in self.aux_pools.values() for i in self.spec.held_layers]

    def _kv_view(self, layer_idx: int, which: int) -> torch.Tensor:
        if self.spec.kind != "gqa":
            raise ValueError("k_cache/v_cache: this cache was built with kind='mla'; use latent_cache")
        pool = self._pool(layer_idx)[:, which]
        return pool if self.spec.layout == "HND" else pool.transpose(1, 2)

    def add_aux_pool(self, name: str, entry_shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        """Register a per-layer auxiliary pool ``[num_blocks, *entry_shape]`` sharing block ids.

        Row ``b`` of an aux pool describes main-cache block ``b`` (e.g. RocketKV's K min/max
        page summaries, the DSA indexer-K cache). Re-registering the same name and geometry
        returns the existing pools.
        """
        shape = (self.spec.num_blocks, *entry_shape)
        if name in self.aux_pools:
            have = self.aux_pools[name][self.spec.held_layers[0]]
            if tuple(have.shape) != shape or have.dtype != dtype:
                raise ValueError(
                    f"aux pool {name!r} exists with shape {tuple(have.shape)} {have.dtype}; asked {shape} {dtype}"
                )
            return self.aux_pools[name]
        held = set(self.spec.held_layers)
        pools = [torch.zeros(shape if i in held else (0, *entry_shape), dtype=dtype, device=self.spec.device)
                 for i in range(self.spec.num_layers)]
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
        pool = self._pool(layer_idx)
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
            lat = self._pool(layer_idx)[blk, off]
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
        pool = self._pool(layer_idx)
        if self.spec.kind == "mla":
            pool[db[0], do[0]] = pool[sb[0], so[0]]
            return
        for which in (0, 1):
            view = self._kv_view(layer_idx, which)  # [blocks, H, P, D]
            h = torch.arange(heads, device=kept.device).unsqueeze(1).expand_as(src)
            view[db, h, do] = view[sb, h, so]
