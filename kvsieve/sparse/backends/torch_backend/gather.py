"""The torch backend's gathers: the K/V a chunk of query tokens reads, as fp32 tiles.

Two ways: whole runs of ``unit`` positions as contiguous rows of the pool (:func:`gather_runs`, one
memcpy per run; contiguous HND GQA pools and MLA latent pools), or one row per selected position
(:func:`gather_positions`, any layout).
"""
from __future__ import annotations

import torch

from ..base import AttentionGeometry
from .prefill import Groups
from .scratch import ScratchPool

__all__ = ["gather_positions", "gather_runs"]


def gather_positions(k_cache: torch.Tensor, v_cache: torch.Tensor, ragged: tuple[torch.Tensor, torch.Tensor],
                     req: torch.Tensor, pos: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V at request-local positions ``pos`` int64 ``[Hkv, n, K]`` (``-1`` = nothing) of the
    tokens' requests ``req`` int64 ``[n]``, from caches indexed ``[block, kv_head, offset, dim]``.
    Returns fp32 K ``[Hkv, n, K, D]``, V ``[Hkv, n, K, Dv]`` and the valid mask ``[Hkv, n, K]``."""
    pages, page_start = ragged
    valid = pos >= 0
    p = pos.clamp(min=0)
    heads = torch.arange(pos.shape[0], device=pos.device).view(-1, 1, 1)
    blk = pages[page_start[req].view(1, -1, 1) + p // page]
    return k_cache[blk, heads, p % page].float(), v_cache[blk, heads, p % page].float(), valid


def gather_runs(pool: torch.Tensor, geometry: AttentionGeometry, ragged: tuple[torch.Tensor, torch.Tensor],
                req: torch.Tensor, lens: torch.Tensor, starts: torch.Tensor, ok: torch.Tensor, groups: Groups | None,
                unit: int, page: int, scratch: ScratchPool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather whole runs of ``unit`` positions as contiguous rows of the pool (``index_select``,
    one memcpy per run) instead of one row per token. GQA HND pool ``[blocks, 2, Hkv, P, D]``
    or MLA latent ``[blocks, P, R+rope]``, contiguous.

    ``req`` int64 ``[n]`` and ``lens`` int64 ``[n]`` are the tokens' requests and kv lengths,
    ``starts``/``ok`` (``[Hkv, n, U]``, as :func:`~.selection.unit_starts`) their runs. A group of tokens
    shares one gather, made for the group's last token (the longest causal range, so a superset
    of the others' valid runs). Returns K ``[Hkv, G, K, D]``, V ``[Hkv, G, K, Dv]`` (fp32;
    ``G`` = groups, or tokens when ``groups`` is ``None``) and the per-token valid mask
    ``[Hkv, n, K]``."""
    hkv = geometry.num_kv_heads
    n, u = starts.shape[1], starts.shape[2]
    pos = (starts.unsqueeze(-1) + torch.arange(unit, device=starts.device)).flatten(2)  # [Hkv, n, U*unit]
    valid = ok.repeat_interleave(unit, dim=2) & (pos < lens.view(1, n, 1))
    if groups is not None:
        starts, req = starts[:, groups.last], req[groups.last]
    pages, page_start = ragged
    blk = pages[page_start[req].view(1, -1, 1) + starts // page]  # [Hkv, G, U]
    sub = (starts % page) // unit
    per_page = page // unit
    rows_g = blk.shape[1]
    if geometry.kind == "mla":
        width = pool.shape[-1]
        flat = pool.view(-1, unit * width)
        lat = scratch.rows("k", flat, (blk * per_page + sub).flatten()).view(1, rows_g, u * unit, width)
        return lat, lat[..., : geometry.kv_lora_rank], valid
    d = pool.shape[-1]
    flat = pool.view(-1, unit * d)
    h = torch.arange(hkv, device=blk.device).view(hkv, 1, 1)
    k_rows = ((blk * 2) * hkv + h) * per_page + sub
    k = scratch.rows("k", flat, k_rows.flatten()).view(hkv, rows_g, u * unit, d)
    v = scratch.rows("v", flat, (k_rows + hkv * per_page).flatten()).view(hkv, rows_g, u * unit, d)
    return k, v, valid
