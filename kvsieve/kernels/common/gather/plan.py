"""The launch plan of the shared gather attention (kernel and reference walk the same tiles), the
shape-only estimates every op planning a gather launch uses, and the validation and plan of a GQA
gather (the GQA decode and the sparse prefill path take the same arguments)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import launch
from ..checks import (FLOAT_DTYPES, check_positive_int, check_query_meta, check_selection, check_stats,
                      check_tensor, check_threshold, resolve_scale, split_head_dim)

__all__ = ["GatherPlan", "plan_gqa_gather", "resolve_splits", "walk_tiles_estimate"]


@dataclass(frozen=True)
class GatherPlan:
    """Everything the gather kernel (and the reference's identical tile walk) needs."""

    arch: str
    group: int  # query heads per KV head
    block_h: int  # query heads per program (rows of the MMA)
    da: int  # K columns of part A (power of two); the rest (dk - da) is part B
    dv: int
    v_is_k: bool  # V = first dv columns of K (MLA latent)
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int
    sm_scale: float
    threshold_scale_factor: float


def walk_tiles_estimate(indices: torch.Tensor | None, num_tokens: int, block_size: int,
                        block_table: torch.Tensor, page_size: int, block_n: int) -> int:
    """KV tiles per program estimated from shapes only (mean selection or table capacity)."""
    if indices is None:
        length = block_table.shape[1] * page_size
    else:
        length = indices.shape[1] * block_size // max(num_tokens, 1)
    return -(-length // block_n)


def resolve_splits(num_splits: int | None, arch: str, programs: int, tiles: int,
                   max_splits: int) -> int:
    """``num_splits`` if given (validated), else the launch heuristic."""
    if num_splits is not None:
        return check_positive_int("num_splits", num_splits)
    return launch.choose_num_splits(arch, max(programs, 1), tiles, max_splits)


def plan_gqa_gather(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, token_to_req: torch.Tensor,
                    kv_lens: torch.Tensor, indices: torch.Tensor | None,
                    offsets: torch.Tensor | None, block_size: int, sm_scale: float | None,
                    threshold_scale_factor: float, stats: torch.Tensor | None,
                    num_splits: int | None) -> GatherPlan:
    """Validate the arguments of a GQA gather (the GQA decode, the sparse prefill path; raises
    ValueError) and choose the launch config."""
    check_tensor("q", q, 3, FLOAT_DTYPES)
    dev = q.device
    check_tensor("k_cache", k_cache, 4, (q.dtype,), dev)
    check_tensor("v_cache", v_cache, 4, (q.dtype,), dev)
    num_tokens, num_q_heads, head_dim = q.shape
    nb, num_kv_heads, page_size, dk = k_cache.shape
    if dk != head_dim:
        raise ValueError(f"k_cache: expected head_dim {head_dim} (q's), got {dk}")
    if tuple(v_cache.shape[:3]) != (nb, num_kv_heads, page_size):
        raise ValueError(f"v_cache: expected leading shape {(nb, num_kv_heads, page_size)}, "
                         f"got {tuple(v_cache.shape[:3])}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"q: expected num_q_heads ({num_q_heads}) to be a multiple of "
                         f"num_kv_heads ({num_kv_heads})")
    if page_size < 1 or head_dim < 16 or v_cache.shape[3] < 16:
        raise ValueError("k_cache/v_cache: expected page_size >= 1 and head dims >= 16")
    check_query_meta(block_table, token_to_req, kv_lens, num_tokens, dev)
    check_selection(indices, offsets, num_tokens, num_kv_heads, block_size, dev)
    check_stats(stats, dev)
    group = num_q_heads // num_kv_heads
    if group > 128:
        raise ValueError(f"q: expected at most 128 query heads per KV head, got {group}")
    arch = launch.detect_arch(dev)
    cfg = launch.gqa_decode_config(arch, head_dim)
    block_h = max(16, 1 << (group - 1).bit_length())
    tiles = walk_tiles_estimate(indices, num_tokens, block_size, block_table, page_size,
                                cfg.block_n)
    splits = resolve_splits(num_splits, arch, num_tokens * num_kv_heads, tiles, cfg.max_splits)
    da, _ = split_head_dim(head_dim)
    return GatherPlan(arch, group, block_h, da, v_cache.shape[3], False, cfg.block_n,
                      cfg.num_warps, cfg.num_stages, splits, resolve_scale(sm_scale, head_dim),
                      check_threshold(threshold_scale_factor))
