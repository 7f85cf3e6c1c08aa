"""Shared plumbing of the built-in selectors: batched reads of the paged cache, deterministic
top-k, the top-p cut of the adaptive budget, and packing the generation rows' selections into
:class:`SparseRuntimeParams`."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from ...metadata import KVCacheManager
from ...sparse import SelectorInputs, SparseRuntimeParams
from ...sparse.knobs import KnobError, knob

__all__ = ["gather_padded_keys", "top_units", "top_units_topk", "top_p_knob", "top_p_cut", "top_p_count", "drop_empty_columns",
           "pack_generation_rows", "check_power_of_two"]


def check_power_of_two(owner: str, field: str, value: int) -> None:
    """Raise :class:`KnobError` naming ``owner.field`` unless ``value`` is a power of two >= 1."""
    if value < 1 or value & (value - 1):
        raise KnobError(f"{owner}.{field} must be a power of two >= 1 (1, 2, 4, 8, ...), got {value}")


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
    lower index (a stable descending sort, so the naive reference and the fast path agree on plateaus).
    Entries whose score is ``-inf`` (invalid units) come back as ``-1``; needs ``k <= N``."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    picked = torch.gather(scores, -1, order)
    return torch.where(torch.isneginf(picked), -1, order)


def top_units_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`top_units` through ``torch.topk`` instead of a full sort (fp32 ``scores``, no NaN,
    ``N < 2**32``; other dtypes take :func:`top_units`): each score's order-preserving int32 image
    (IEEE bits, negatives flipped; ``-0.0`` as ``+0.0``) is shifted left 32 bits and joined with
    ``2**32 - 1 - index``, so every key is distinct and ties rank the lower index first — the
    stable sort's order, found by a partial selection. The keys are built in place (one int64
    tensor, no temporaries the size of ``scores`` beyond the int32 image)."""
    n = scores.shape[-1]
    if scores.dtype != torch.float32 or n >= 2 ** 32:
        return top_units(scores, k)
    bits = (scores + 0.0).view(torch.int32)
    bits ^= (bits >> 31) & 0x7FFFFFFF  # negatives flipped: the int32 order is the float order
    keys = bits.to(torch.int64).bitwise_left_shift_(32)
    keys += 2 ** 32 - 1 - torch.arange(n, device=scores.device)
    order = torch.topk(keys, k, dim=-1, sorted=True).indices
    picked = torch.gather(scores, -1, order)
    return torch.where(torch.isneginf(picked), -1, order)


def top_p_knob() -> float | None:
    """The ``top_p`` field of a top-p capable selector's config (``None`` = fixed budget)."""
    return knob(None, gt=0.0, le=1.0, doc="estimated attention mass to keep; None = fixed budget")


def top_p_cut(sel: torch.Tensor, mass: torch.Tensor, total: torch.Tensor, p: float) -> torch.Tensor:
    """The adaptive budget (Twilight, arXiv 2502.02770): ``sel [..., k]`` unit ids in rank order
    (``-1`` = none, only at the tail) with ``-1`` written past the shortest prefix whose mass
    reaches ``p * total [...]``. ``mass [..., k]`` fp32 is each entry's (estimated) mass, ignored
    where ``sel`` is ``-1``; an entry is kept while the mass of the entries before it is below
    ``p * total``, so the first is always kept and a row whose ``k`` entries fall short keeps all.
    ``p = 1`` keeps every entry (rounding of the sums never cuts the tail)."""
    if p >= 1.0:
        return sel
    m = torch.where(sel >= 0, mass, torch.zeros_like(mass))
    before = torch.cat([torch.zeros_like(m[..., :1]), m.cumsum(-1)[..., :-1]], dim=-1)
    return torch.where(before < p * total.unsqueeze(-1), sel, torch.full_like(sel, -1))


def top_p_count(mass: torch.Tensor, p: float) -> int:
    """How many of the units with masses ``mass [k]`` (in rank order) :func:`top_p_cut` keeps,
    one unit at a time: the plain reference of the per-row cut."""
    if p >= 1.0:
        return mass.numel()
    before = 0.0
    for j, m in enumerate(mass.tolist()):
        if before >= p:
            return j
        before += m
    return mass.numel()


def drop_empty_columns(sel: torch.Tensor) -> torch.Tensor:
    """``sel [..., k]`` (kept entries first, ``-1`` after) without the trailing columns no row
    keeps; at least one column stays."""
    return sel[..., : max(int((sel >= 0).sum(-1).amax()) if sel.numel() else 0, 1)]


def pack_generation_rows(sel: torch.Tensor, inputs: SelectorInputs, block_size: int) -> SparseRuntimeParams:
    """Pack ``sel [Tg, Hkv, k]`` (unit ids, ``-1`` = none) of the generation rows among
    ``inputs.rows`` into a carrier over all of ``inputs.rows``: the context rows before them get
    empty segments and stay outside ``selected_phases`` (they attend densely)."""
    packed = SparseRuntimeParams.from_topk(sel, block_size=block_size, selected_phases=frozenset({"generation"}))
    n_ctx = inputs.metadata.generation_rows.start - inputs.rows.start
    off = packed.sparse_attn_offsets
    return replace(packed, sparse_attn_offsets=torch.cat([off.new_zeros(n_ctx), off]))
