"""Sparse paged GQA decode at block granularity on the CuTe gather-attention kernel (SM90 wgmma /
SM100 tcgen05). Reference: ``naive.sparse_gqa_decode`` (without skip-softmax, one split).

The query heads of one KV head's group are the M operand of the MMAs, padded with zero rows to
the MMA minimum (64 rows on SM90, 128 on SM100; a group of 4..16 therefore uses 6-25 % of the
rows: the MMA runs but the bandwidth-bound gather dominates). Selected blocks are expanded to
their ``block_size`` token rows on the device and each page row is gathered whole (one 16-byte
``cp.async`` per 8 values); K and V rows come from their own pools, V staged in its own buffer.
"""
from __future__ import annotations

import torch

from ..common.checks import check_query_meta, check_selection, check_tensor, resolve_scale
from ..common.gather.cute.host import BLOCK_N, launch, pad_rows, request_local_to_rows, require_arch

__all__ = ["sparse_gqa_decode"]


def _row_view(name: str, cache: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    d = cache.shape[3]
    if cache.stride(3) != 1 or any(s % d for s in cache.stride()[:3]) or d % 64:
        raise ValueError(f"{name}: expected head_dim a multiple of 64, a unit last stride and "
                         f"other strides multiple of head_dim, got shape {tuple(cache.shape)} "
                         f"strides {cache.stride()}")
    n_rows = (cache.untyped_storage().nbytes() // cache.element_size()
              - cache.storage_offset()) // d
    view = cache.as_strided((n_rows, d), (d, 1))
    return view, tuple(s // d for s in cache.stride()[:3])


def sparse_gqa_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_table: torch.Tensor, token_to_req: torch.Tensor,
                      kv_lens: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
                      block_size: int = 1, sm_scale: float | None = None,
                      num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same arguments/result as ``kvsieve.kernels.sparse_gqa_decode.triton.sparse_gqa_decode`` (sparse only).

    Args:
        q: ``[T, Hq, D]`` bf16, D a multiple of 64 (<= 256), unit last stride.
        k_cache / v_cache: ``[num_blocks, Hkv, page_size, D]`` bf16 (HND ``pool[:, 0]`` or NHD
            ``pool[:, 0].transpose(1, 2)``), strides multiples of D.
        block_table, token_to_req, kv_lens, indices ``[Hkv, total]``, offsets ``[T+1]``,
            block_size: as the Triton kernel (-1 and positions ``>= kv_lens[t]`` skipped).
    Returns:
        ``out [T, Hq, D]`` bf16, ``lse [T, Hq]`` fp32 natural log (empty: 0 / +inf).
    """
    check_tensor("q", q, 3, (torch.bfloat16,))
    dev = q.device
    check_tensor("k_cache", k_cache, 4, (torch.bfloat16,), dev)
    check_tensor("v_cache", v_cache, 4, (torch.bfloat16,), dev)
    t, hq, d = q.shape
    nb, hkv, page, dk = k_cache.shape
    if dk != d or tuple(v_cache.shape) != tuple(k_cache.shape) or d > 256:
        raise ValueError(f"k_cache/v_cache: expected equal shapes [*, *, *, {d}] with "
                         f"head_dim <= 256, got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if hq % hkv or not 1 <= hq // hkv <= 128:
        raise ValueError(f"q: expected num_q_heads ({hq}) a multiple of num_kv_heads ({hkv}) "
                         f"with a group of at most 128")
    check_query_meta(block_table, token_to_req, kv_lens, t, dev)
    if indices is None:
        raise ValueError("indices: the CuTe GQA kernel is sparse only (dense: use 'triton')")
    check_selection(indices, offsets, t, hkv, block_size, dev)
    arch = require_arch(dev)
    k_rows, ks = _row_view("k_cache", k_cache)
    v_rows, vs = _row_view("v_cache", v_cache)
    if ks != vs:
        raise ValueError("v_cache: expected the same strides as k_cache")
    slots = request_local_to_rows(indices, offsets, token_to_req, block_table, kv_lens, page,
                                  block_size)
    blk, off = slots // page, slots % page
    head = torch.arange(hkv, device=dev, dtype=torch.int32)[None, :, None]
    rows = torch.where(slots >= 0, blk * ks[0] + head * ks[1] + off * ks[2],
                       torch.full_like(slots, -1)).to(torch.int32)
    return launch("gqa", q, k_rows, v_rows, pad_rows(rows, BLOCK_N[arch]), d,
                  resolve_scale(sm_scale, d), num_splits)
