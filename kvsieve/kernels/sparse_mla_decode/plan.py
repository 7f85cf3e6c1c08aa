"""Validation and launch planning shared by the MLA decode kernel and its reference."""
from __future__ import annotations

import torch

from ..common import launch
from ..common.checks import (FLOAT_DTYPES, check_positive_int, check_query_meta, check_selection, check_stats,
                             check_tensor, check_threshold, resolve_scale)
from ..common.gather.plan import GatherPlan, resolve_splits, walk_tiles_estimate


def latent_views(latent_cache: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
    """``[num_blocks, 1, page_size, D]`` K view and its first ``kv_lora_rank`` columns as V."""
    k4 = latent_cache.unsqueeze(1)
    return k4, k4[..., :kv_lora_rank]


def plan_mla_decode(q: torch.Tensor, latent_cache: torch.Tensor, block_table: torch.Tensor,
                    token_to_req: torch.Tensor, kv_lens: torch.Tensor,
                    indices: torch.Tensor | None, offsets: torch.Tensor | None,
                    kv_lora_rank: int, sm_scale: float | None, threshold_scale_factor: float,
                    stats: torch.Tensor | None, num_splits: int | None, block_size: int = 1) -> GatherPlan:
    """Validate absorbed-MLA decode arguments (raises ValueError) and choose the launch."""
    check_tensor("q", q, 3, FLOAT_DTYPES)
    dev = q.device
    check_tensor("latent_cache", latent_cache, 3, (q.dtype,), dev)
    num_tokens, num_heads, dk = q.shape
    if latent_cache.shape[2] != dk:
        raise ValueError(f"latent_cache: expected last dim {dk} (q's), got "
                         f"{latent_cache.shape[2]}")
    check_positive_int("kv_lora_rank", kv_lora_rank)
    if not 16 <= kv_lora_rank <= dk:
        raise ValueError(f"kv_lora_rank: expected 16 <= kv_lora_rank <= {dk}, "
                         f"got {kv_lora_rank}")
    if kv_lora_rank & (kv_lora_rank - 1):
        raise ValueError(f"kv_lora_rank: expected a power of two, got {kv_lora_rank}")
    if latent_cache.shape[1] < 1:
        raise ValueError("latent_cache: expected page_size >= 1")
    if num_heads < 1:
        raise ValueError("q: expected at least one head")
    check_query_meta(block_table, token_to_req, kv_lens, num_tokens, dev)
    check_selection(indices, offsets, num_tokens, 1, block_size, dev)
    check_stats(stats, dev)
    arch = launch.detect_arch(dev)
    cfg = launch.mla_decode_config(arch, num_heads)
    n_hblocks = -(-num_heads // cfg.block_h)
    tiles = walk_tiles_estimate(indices, num_tokens, block_size, block_table, latent_cache.shape[1],
                                cfg.block_n)
    splits = resolve_splits(num_splits, arch, num_tokens * n_hblocks, tiles, cfg.max_splits)
    return GatherPlan(arch, num_heads, cfg.block_h, kv_lora_rank, kv_lora_rank, True,
                      cfg.block_n, cfg.num_warps, cfg.num_stages, splits,
                      resolve_scale(sm_scale, dk), check_threshold(threshold_scale_factor))
