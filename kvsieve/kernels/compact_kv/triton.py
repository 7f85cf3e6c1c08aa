"""In-place KV-cache compaction after prompt-token eviction, in Triton."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import launch
from ..common.checks import FLOAT_DTYPES, check_tensor, next_pow2
from .plan import check_keep


@triton.jit
def compact_kernel(K, V, BT, KEEP, n_keep,
                    stride_kb, stride_kh, stride_kp, stride_kd,
                    stride_vb, stride_vh, stride_vp, stride_vd, stride_keep,
                    PAGE_SIZE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                    HAS_V: tl.constexpr):
    # One program per KV head walks its kept list in ascending tiles. Destination j <= source
    # kept[j] (sorted, unique), so a tile only overwrites positions < its own end, which no
    # later tile reads (later sources are >= their destinations >= this tile's end). Inside a
    # tile a destination may equal another lane's source: the barrier orders all loads before
    # any store. Heads are disjoint memory, so programs never race.
    h = tl.program_id(0)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    for start in range(0, n_keep, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        src = tl.load(KEEP + h * stride_keep + j, mask=j < n_keep, other=-1)
        ok = src >= 0
        s_page = tl.load(BT + src // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
        d_page = tl.load(BT + j // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
        s_k = K + s_page * stride_kb + h * stride_kh + (src % PAGE_SIZE) * stride_kp
        d_k = K + d_page * stride_kb + h * stride_kh + (j % PAGE_SIZE) * stride_kp
        k = tl.load(s_k[:, None] + dk[None, :] * stride_kd, mask=ok[:, None] & (dk[None, :] < DK))
        if HAS_V:
            s_v = V + s_page * stride_vb + h * stride_vh + (src % PAGE_SIZE) * stride_vp
            v = tl.load(s_v[:, None] + dv[None, :] * stride_vd,
                        mask=ok[:, None] & (dv[None, :] < DV))
        tl.debug_barrier()
        tl.store(d_k[:, None] + dk[None, :] * stride_kd, k, mask=ok[:, None] & (dk[None, :] < DK))
        if HAS_V:
            d_v = V + d_page * stride_vb + h * stride_vh + (j % PAGE_SIZE) * stride_vp
            tl.store(d_v[:, None] + dv[None, :] * stride_vd, v,
                     mask=ok[:, None] & (dv[None, :] < DV))
        tl.debug_barrier()


def _launch(k4: torch.Tensor, v4: torch.Tensor | None, block_table_row: torch.Tensor,
            kept: torch.Tensor) -> None:
    n_keep = kept.shape[1]
    if n_keep == 0:
        return
    arch = launch.detect_arch(k4.device)
    vv = v4 if v4 is not None else k4
    compact_kernel[(k4.shape[1],)](
        k4, vv, block_table_row, kept, n_keep, *k4.stride(), *vv.stride(), kept.stride(0),
        PAGE_SIZE=k4.shape[2], DK=k4.shape[3], DV=vv.shape[3],
        BLOCK_N=launch.COMPACT_BLOCK_N[arch], BLOCK_DK=next_pow2(k4.shape[3]),
        BLOCK_DV=next_pow2(vv.shape[3]), HAS_V=v4 is not None, num_warps=4, num_stages=1)


def compact_kv_(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table_row: torch.Tensor,
                kept_indices: torch.Tensor) -> None:
    """Move each head's kept prompt tokens of one request to the front of its pages, in place.

    Args:
        k_cache, v_cache: ``[num_blocks, num_kv_heads, page_size, head_dim(_v)]`` views, same
            dtype, any strides; modified in place.
        block_table_row: ``[max_blocks_per_seq]`` int32, the request's pages.
        kept_indices: ``[num_kv_heads, n_keep]`` int32 request-local positions, strictly
            ascending per head (-1 padding allowed at the end). Kept token ``j`` of head ``h``
            moves to position ``j``; positions ``>= n_keep`` are left as they were.

    Ascending order guarantees destination <= source, so walking tiles in order reads every
    source before any write can reach it (see the kernel comment). Ordering is not checked
    (no device sync); the caller's ``SparseRuntimeParams.validate`` checks it.
    """
    check_tensor("k_cache", k_cache, 4, FLOAT_DTYPES)
    check_tensor("v_cache", v_cache, 4, (k_cache.dtype,), k_cache.device)
    if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
        raise ValueError(f"v_cache: expected leading shape {tuple(k_cache.shape[:3])}, "
                         f"got {tuple(v_cache.shape[:3])}")
    check_keep(block_table_row, kept_indices, k_cache.shape[1], k_cache.device)
    _launch(k_cache, v_cache, block_table_row, kept_indices)


def compact_mla_kv_(latent_cache: torch.Tensor, block_table_row: torch.Tensor,
                    kept_indices: torch.Tensor) -> None:
    """MLA variant of :func:`compact_kv_`: ``latent_cache [num_blocks, page_size, D]`` (any
    strides) compacted in place with ``kept_indices [1, n_keep]`` int32 ascending."""
    check_tensor("latent_cache", latent_cache, 3, FLOAT_DTYPES)
    check_keep(block_table_row, kept_indices, 1, latent_cache.device)
    _launch(latent_cache.unsqueeze(1), None, block_table_row, kept_indices)
