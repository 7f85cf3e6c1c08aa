"""Shared plumbing of the built-in selectors: batched reads of the paged cache, deterministic
top-k, and packing the generation rows' selections into :class:`SparseRuntimeParams`."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from ..metadata import KVCacheManager
from ..sparse import SelectorInputs, SparseRuntimeParams

__all__ = ["gather_padded_keys", "top_units", "pack_generation_rows", "check_power_of_two"]


def check_power_of_two(owner: str, field: str, value: int) -> None:
    """Raise ``ValueError`` naming ``owner.field`` unless ``value`` is a power of two >= 1."""
    if value < 1 or value & (value - 1):
        raise ValueError(f"{owner}: {field} must be a power of two >= 1 (1, 2, 4, 8, ...), got {value}")


def gather_padded_keys(cache: KVCacheManager, layer_idx: int, slots: np.ndarray, lens: np.ndarray
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys of several requests in one gather through the block table (no per-request loop).

    ``slots``/``lens``: int arrays ``[B]`` (cache slots, keys to read per request).
    Returns K ``[B, Lmax, Hkv, D]`` in the cache dtype (rows past a request's length hold
    arbitrary finite values) and ``valid`` bool ``[B, Lmax]``.
    """
    dev = cache.spec.device
    lmax = int(lens.max()) if len(lens) else 0
    p = cache.tokens_per_block
    pos = torch.arange(lmax, device=dev)
    nblk = max(-(-lmax // p), 1)
    table = torch.from_numpy(cache.block_table[slots, :nblk].astype(np.int64)).to(dev)  # [B, nblk]
    blk = table[:, pos // p]  # [B, Lmax]
    keys = cache.k_cache(layer_idx)[blk, :, pos % p]  # [B, Lmax, Hkv, D]
    valid = pos.unsqueeze(0) < torch.as_tensor(lens, device=dev, dtype=torch.int64).unsqueeze(1)
    return keys, valid


def top_units(scores: torch.Tensor, k: int) -> torch.Tensor:
    """int64 ``[..., k]``: the ``k`` highest entries of ``scores [..., N]``, ties broken by the
    lower index (a stable descending sort, so the golden and the fast path agree on plateaus).
    Entries whose score is ``-inf`` (invalid units) come back as ``-1``; needs ``k <= N``."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    picked = torch.gather(scores, -1, order)
    return torch.where(torch.isneginf(picked), -1, order)


def pack_generation_rows(sel: torch.Tensor, inputs: SelectorInputs, block_size: int) -> SparseRuntimeParams:
    """Pack ``sel [Tg, Hkv, k]`` (unit ids, ``-1`` = none) of the generation rows among
    ``inputs.rows`` into a carrier over all of ``inputs.rows``: the context rows before them get
    empty segments and stay outside ``selected_phases`` (they attend densely)."""
    packed = SparseRuntimeParams.from_topk(sel, block_size=block_size, selected_phases=frozenset({"generation"}))
    n_ctx = inputs.metadata.generation_rows.start - inputs.rows.start
    off = packed.sparse_attn_offsets
    return replace(packed, sparse_attn_offsets=torch.cat([off.new_zeros(n_ctx), off]))
