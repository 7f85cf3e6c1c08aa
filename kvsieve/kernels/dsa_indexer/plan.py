"""Argument validation and launch table of the DSA indexer logits (kernel and reference)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.checks import check_shape, check_tensor

__all__ = ["IndexerLaunch", "INDEXER_LAUNCH", "INDEX_DTYPES", "check_prefill_args", "check_decode_args"]

INDEX_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)


@dataclass(frozen=True)
class IndexerLaunch:
    """One program = one query token x ``block_n`` keys; its ``n_heads`` index heads are the MMA's
    M side (64 heads -> wgmma/tcgen05 tiles)."""

    block_n: int
    num_warps: int
    num_stages: int


# Verified by ``python -m kvsieve.kernels.aot.dsa_report`` (0 spills, smem < 227 KiB).
INDEXER_LAUNCH: dict[str, IndexerLaunch] = {
    "interpreter": IndexerLaunch(block_n=256, num_warps=4, num_stages=1),
    "sm90": IndexerLaunch(block_n=64, num_warps=4, num_stages=3),
    "sm100": IndexerLaunch(block_n=128, num_warps=8, num_stages=3),
    "other": IndexerLaunch(block_n=32, num_warps=4, num_stages=2),
}


def _common(q: torch.Tensor, weights: torch.Tensor, width: int) -> None:
    check_tensor("q", q, 3, INDEX_DTYPES)
    check_tensor("weights", weights, 2, (torch.float32,), q.device)
    check_shape("weights", weights, (q.shape[0], q.shape[1]))
    if q.shape[2] > 0 and q.stride(2) != 1:
        raise ValueError("q: expected a unit stride along head_dim")
    if not isinstance(width, int) or width < 0:
        raise ValueError(f"width: expected an int >= 0, got {width!r}")


def _key_dtype(name: str, k: torch.Tensor, q: torch.Tensor) -> None:
    if k.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name}: expected dtype in {INDEX_DTYPES}, got {k.dtype}")
    if k.shape[-1] != q.shape[2]:
        raise ValueError(f"{name}: expected head_dim {q.shape[2]} (q's), got {k.shape[-1]}")
    if k.shape[-1] > 0 and k.stride(-1) != 1:
        raise ValueError(f"{name}: expected a unit stride along head_dim")


def check_prefill_args(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor | None, weights: torch.Tensor,
                       k_start: torch.Tensor, k_len: torch.Tensor, width: int) -> None:
    """Shapes/dtypes of the ragged prefill logits (no device sync)."""
    _common(q, weights, width)
    check_tensor("k", k, 2, None, q.device)
    _key_dtype("k", k, q)
    if k_scale is not None:
        check_tensor("k_scale", k_scale, 1, (torch.float32,), q.device)
        check_shape("k_scale", k_scale, (k.shape[0],))
    for name, t in (("k_start", k_start), ("k_len", k_len)):
        check_tensor(name, t, 1, (torch.int32,), q.device)
        check_shape(name, t, (q.shape[0],))


def check_decode_args(q: torch.Tensor, k_cache: torch.Tensor, k_scale_cache: torch.Tensor | None,
                      weights: torch.Tensor, block_table: torch.Tensor, token_to_req: torch.Tensor,
                      kv_lens: torch.Tensor, width: int) -> None:
    """Shapes/dtypes of the paged decode logits (no device sync)."""
    _common(q, weights, width)
    check_tensor("k_cache", k_cache, 3, None, q.device)
    _key_dtype("k_cache", k_cache, q)
    if k_scale_cache is not None:
        check_tensor("k_scale_cache", k_scale_cache, 2, (torch.float32,), q.device)
        check_shape("k_scale_cache", k_scale_cache, tuple(k_cache.shape[:2]))
    check_tensor("block_table", block_table, 2, (torch.int32,), q.device)
    if block_table.stride(1) != 1:
        raise ValueError("block_table: expected a unit stride along max_blocks")
    for name, t in (("token_to_req", token_to_req), ("kv_lens", kv_lens)):
        check_tensor(name, t, 1, (torch.int32,), q.device)
        check_shape(name, t, (q.shape[0],))
