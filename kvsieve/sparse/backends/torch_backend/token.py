"""The torch backend's one-token path on CPU: the decode step of one request.

A phase or chunk of a single query row over a contiguous HND GQA pool skips the batched path's
set-up: its runs of positions are computed on the host (numpy; a few hundred entries), then the
native kernel (:mod:`kvsieve.kernels.sparse_gqa_decode.native`) reads them in place, or, where its library
is unavailable, one K+V gather and PyTorch's fused CPU flash kernel. A decode step's cost is mostly
per-op overhead; this is about a third of the batched path's ops.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ....kernels.common.native import NativeUnavailable
from ....kernels.sparse_gqa_decode.native import sparse_decode_native, supports_native
from ....metadata import AttentionMetadata
from ...params import SparseRuntimeParams
from ..base import AttentionGeometry
from .prefill import flash_cpu
from .scratch import ScratchPool

__all__ = ["attend_token", "token_path"]


def token_path(q: torch.Tensor, metadata: AttentionMetadata, layer_idx: int, geometry: AttentionGeometry) -> bool:
    """Whether a single query row takes :func:`attend_token`: a contiguous HND GQA pool on CPU."""
    mgr = metadata.kv_cache_manager
    return (geometry.kind == "gqa" and q.device.type == "cpu" and mgr.spec.layout == "HND"
            and mgr.pools[layer_idx].is_contiguous())


def attend_token(q: torch.Tensor, metadata: AttentionMetadata, t: int, pool: torch.Tensor, geometry: AttentionGeometry,
                 params: SparseRuntimeParams | None, scratch: ScratchPool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """Query row ``t`` alone (a phase or chunk of one token: the decode step of one request) over a
    contiguous HND GQA pool on CPU: the same runs and masks as the batched path, their index
    arithmetic on the host (numpy; a few hundred entries) and one K+V gather, then PyTorch's
    fused CPU flash kernel — or, where its library builds, the native kernel
    (:mod:`kvsieve.kernels.sparse_gqa_decode.native`) reads the runs in place instead of the gather and
    the flash kernel. A decode step's cost is mostly per-op overhead; this is about a third of
    the batched path's ops. Returns fp32 out ``[Hq, Dv]``, fp32 lse ``[Hq]``, the positions each
    KV head read, int64 ``[Hkv]``, and the path: ``"runs_native"`` or ``"runs"``."""
    hkv, d = geometry.num_kv_heads, pool.shape[-1]
    page = metadata.kv_cache_manager.tokens_per_block
    rpt = metadata.ragged_page_table
    kv_len = int(metadata.positions_host[t]) + 1
    first = int(rpt.paged_kv_indptr_buf.numpy()[metadata.token_to_req_host[t]])
    # runs of `unit` tokens, as request-local run ids [Hkv, U] (run u covers positions [u*unit, (u+1)*unit))
    if params is None:
        unit = page
        runs = np.broadcast_to(np.arange(-(-kv_len // unit)), (hkv, -(-kv_len // unit)))
    else:
        bs = params.sparse_attn_indices_block_size
        unit = math.gcd(bs, page)
        o0, o1 = params.sparse_attn_offsets.numpy()[t: t + 2].tolist()
        sel = np.sort(params.sparse_attn_indices.numpy()[:, o0:o1].astype(np.int64), axis=-1)  # [Hkv, k], -1 first
        ok = sel >= 0
        ok[:, 1:] &= sel[:, 1:] != sel[:, :-1]  # a repeated unit is read once
        if bs != unit:  # a selected block is several runs
            sel = ((sel * (bs // unit))[..., None] + np.arange(bs // unit)).reshape(hkv, -1)
            ok = np.repeat(ok, bs // unit, axis=1)
        ok &= sel * unit < kv_len
        runs = np.where(ok, sel, 0)
    per_page = page // unit
    blk = rpt.paged_kv_indices_buf.numpy()[first + (runs if per_page == 1 else runs // per_page)]  # [Hkv, U]
    # row ids in the pool viewed as [num_blocks * 2 * Hkv * per_page, unit * D] (K, then V rows)
    k_rows = blk.astype(np.int64) * (2 * hkv * per_page) + np.arange(0, hkv * per_page, per_page)[:, None]
    if per_page > 1:
        k_rows += runs % per_page
    # a run's valid positions are its first `cnt` (those before kv_len), none when not ok
    cnt = np.minimum(kv_len - runs * unit, unit) if params is None else np.where(
        ok, np.minimum(kv_len - runs * unit, unit), 0)  # [Hkv, U] (an ok run starts before kv_len)
    counts = np.full(hkv, kv_len, dtype=np.int64) if params is None else cnt.sum(-1)
    rows = pool.view(-1, unit * d)
    if supports_native(rows, q[t], hkv):  # the C kernel reads the runs in place
        try:
            o, row_lse = sparse_decode_native(rows, k_rows, cnt, hkv * per_page, q[t], sm_scale=geometry.sm_scale)
            return o, row_lse, torch.from_numpy(counts), "runs_native"
        except NativeUnavailable:
            pass
    kv = scratch.rows("kv", rows, torch.from_numpy(
        (k_rows.reshape(1, -1) + np.array([[0], [hkv * per_page]])).ravel())).view(2, 1, hkv, -1, d)
    k, v = kv.unbind(0)  # [1, Hkv, U*unit, D]
    qs = q[t].view(1, hkv, -1, d)  # [1, Hkv, g, D]: the KV heads as heads, a group's query heads as rows
    if qs.dtype != torch.float32:
        qs = qs.float()
    if params is None:  # dense: the valid positions are the prefix [0, kv_len) of the runs
        o, row_lse = flash_cpu(qs, k[:, :, :kv_len], v[:, :, :kv_len], None, geometry.sm_scale)
    else:
        width = int(counts[0])
        # runs are sorted, so a partial run (the newest page's written head) is the last ok one:
        # when no run that is not ok precedes an ok one, each head's valid positions are the
        # first counts[h] of its runs
        if width and bool((counts == width).all()) and (ok.all() or bool((ok[:, :-1] >= ok[:, 1:]).all())):
            # every head's valid positions are the same-length prefix: no mask, only a shorter K/V
            if width < k.shape[2]:
                k, v = k[:, :, :width], v[:, :, :width]
            o, row_lse = flash_cpu(qs, k, v, None, geometry.sm_scale)
        else:
            valid = (np.arange(unit) < cnt[..., None]).reshape(hkv, -1)  # [Hkv, U*unit]
            bias = torch.from_numpy(np.where(valid, np.float32(0), np.float32(-np.inf)))
            o, row_lse = flash_cpu(qs, k, v, bias.view(1, hkv, 1, -1).expand(-1, -1, qs.shape[2], -1),
                                   geometry.sm_scale)
        if not counts.all():  # a head that attends nothing: out 0, lse inf
            empty = torch.from_numpy(counts == 0).view(1, hkv, 1)
            o, row_lse = o.masked_fill(empty.unsqueeze(-1), 0.0), row_lse.masked_fill(empty, torch.inf)
    return o.reshape(-1, o.shape[-1]), row_lse.reshape(-1), torch.from_numpy(counts), "runs"
