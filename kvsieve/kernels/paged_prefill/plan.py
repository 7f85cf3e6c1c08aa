"""Path selection, query tiling and launch planning for paged prefill (kernel + reference)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common import launch
from ..common.checks import check_threshold, next_pow2, resolve_scale, split_head_dim

PATHS = ("dense_tiled", "sparse_gather")


def select_prefill_path(indices: torch.Tensor | None) -> str:
    """Which prefill path ``paged_prefill`` runs for this selection.

    ``"dense_tiled"`` (``indices is None``): query tiles of consecutive tokens of one request x
    the GQA group, causal mask per token from ``kv_lens``. ``"sparse_gather"``: every token
    attends its own selection through the gather kernel of ``sparse_gqa_decode``.
    """
    return "dense_tiled" if indices is None else "sparse_gather"


@dataclass(frozen=True)
class PrefillPlan:
    """Launch parameters of the dense tiled prefill kernel (and its reference's walk)."""

    arch: str
    group: int
    group_pad: int  # group padded to a power of two (rows per token in a query tile)
    tokens_per_tile: int
    block_m: int  # rows per program = tokens_per_tile * group_pad
    block_n: int
    da: int
    dv: int
    num_warps: int
    num_stages: int
    sm_scale: float
    threshold_scale_factor: float


def plan_dense_prefill(q: torch.Tensor, num_kv_heads: int, dv: int, sm_scale: float | None,
                       threshold_scale_factor: float) -> PrefillPlan:
    """Tile sizes of the dense path (inputs already validated by ``plan_gqa_gather``)."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    arch = launch.detect_arch(q.device)
    cfg = launch.prefill_config(arch, head_dim, group)
    group_pad = next_pow2(group)
    block_m = max(cfg.block_m, group_pad, 16)
    da, _ = split_head_dim(head_dim)
    return PrefillPlan(arch, group, group_pad, block_m // group_pad, block_m, cfg.block_n, da,
                       dv, cfg.num_warps, cfg.num_stages, resolve_scale(sm_scale, head_dim),
                       check_threshold(threshold_scale_factor))


def query_tiles(token_to_req: torch.Tensor, tokens_per_tile: int) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """Cut runs of consecutive tokens with the same request into tiles (vectorised torch).

    Returns ``(tile_start [n_tiles] int32, tile_count [n_tiles] int32)``: tile ``i`` holds
    tokens ``tile_start[i] .. tile_start[i] + tile_count[i] - 1``, all of one request.
    """
    n = token_to_req.shape[0]
    dev = token_to_req.device
    change = torch.ones(n, dtype=torch.bool, device=dev)
    change[1:] = token_to_req[1:] != token_to_req[:-1]
    seg_start = torch.nonzero(change).flatten()
    seg_end = torch.cat([seg_start[1:], torch.tensor([n], device=dev)])
    n_tiles = (seg_end - seg_start + tokens_per_tile - 1) // tokens_per_tile
    seg_of_tile = torch.repeat_interleave(torch.arange(seg_start.numel(), device=dev), n_tiles)
    first = torch.repeat_interleave(torch.cumsum(n_tiles, 0) - n_tiles, n_tiles)
    within = torch.arange(seg_of_tile.numel(), device=dev) - first
    start = seg_start[seg_of_tile] + within * tokens_per_tile
    count = torch.minimum(seg_end[seg_of_tile] - start, torch.full_like(start, tokens_per_tile))
    return start.to(torch.int32), count.to(torch.int32)
