"""The gather-attention Triton kernel shared by GQA decode, sparse prefill and MLA decode, and its
tile steps (``dot``, ``keep_tile``, ``softmax_tile``, ``finish_rows``) that the dense prefill reuses.

One program handles one query token, one KV head and one block of ``BLOCK_H`` query heads of
that KV head's group (GQA: the whole group padded to 16; MLA: a head group), and one split of
the KV walk. The walk runs over an *expanded* position space of length ``L``: dense
``L = kv_len``; sparse ``L = n_entries * SEL_BLOCK`` where index ``j`` maps to entry
``j // SEL_BLOCK`` and position ``idx[entry] * SEL_BLOCK + j % SEL_BLOCK``. Positions that are
padding (-1) or ``>= kv_len`` are masked and never loaded. KV tiles of ``BLOCK_N`` expanded
positions are gathered through the block table (arbitrary cache strides). K is split into a
power-of-two part A (``DA``) and an optional part B (``DB``: MLA rope / head-dim remainder).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import next_pow2
from ..merge_states.triton import merge_states

LN2 = tl.constexpr(0.6931471805599453)
LOG2E = 1.4426950408889634


@triton.jit
def dot(a, b, F32DOT: tl.constexpr):
    # The interpreter computes bf16 dots on raw bits (triton#11584): upcast when interpreting.
    if F32DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def keep_tile(tile_max, m_i, lam, row_valid):
    """The skip-softmax (BLASST) rule of one KV tile: computed unless, for every real row,
    ``exp(tile_max - running_max) < lam`` (log2 domain; a row with no running max yet keeps it)."""
    keep_row = (tl.exp2(tile_max - tl.maximum(m_i, -3.0e38)) >= lam) & row_valid
    return tl.sum(keep_row.to(tl.int32), 0) > 0


@triton.jit
def softmax_tile(s, tile_max, m_i, l_i, acc, v, F32DOT: tl.constexpr):
    """One online-softmax step (log2 domain): fold the tile's scores ``s [rows, n]`` and values
    ``v [n, dv]`` into the running max ``m_i``, sum ``l_i`` and unnormalised output ``acc``."""
    m_new = tl.maximum(m_i, tile_max)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, F32DOT)
    return m_new, l_i, acc


@triton.jit
def finish_rows(acc, l_i, m_i):
    """Normalised output and natural-log LSE of the walked rows (a row that read nothing: 0, +inf)."""
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("inf"))
    return out, lse


@triton.jit
def gather_attn_fwd(
    Q, K, V, BT, TOK2REQ, KVLEN, IDX, OFF, O, LSE, STATS,
    qk_scale, threshold_scale_factor, num_splits,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kp, stride_kd,
    stride_vb, stride_vh, stride_vp, stride_vd,
    stride_bt, stride_ih,
    stride_ot, stride_oh, stride_os, stride_od,
    stride_lt, stride_lh, stride_ls,
    GROUP: tl.constexpr, N_HBLOCKS: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SEL_BLOCK: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DA: tl.constexpr,
    BLOCK_DB: tl.constexpr, BLOCK_DV: tl.constexpr,
    SPARSE: tl.constexpr, SKIP: tl.constexpr, COUNT: tl.constexpr, V_IS_K: tl.constexpr,
    F32DOT: tl.constexpr,
):
    t = tl.program_id(0)
    kvh = tl.program_id(1) // N_HBLOCKS
    hb = tl.program_id(1) % N_HBLOCKS
    split = tl.program_id(2)
    kv_len = tl.load(KVLEN + t)
    req = tl.load(TOK2REQ + t).to(tl.int64)
    if SPARSE:
        start = tl.load(OFF + t)
        walk_len = (tl.load(OFF + t + 1) - start) * SEL_BLOCK
    else:
        start = 0
        walk_len = kv_len
    n_tiles = tl.cdiv(walk_len, BLOCK_N)
    per_split = tl.cdiv(n_tiles, num_splits)
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, n_tiles)

    hrow = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    row_valid = hrow < GROUP
    qh = kvh * GROUP + hrow
    da = tl.arange(0, BLOCK_DA)
    db = tl.arange(0, BLOCK_DB)
    dv = tl.arange(0, BLOCK_DV)
    q_row = Q + t.to(tl.int64) * stride_qt + qh[:, None] * stride_qh
    qa = tl.load(q_row + da[None, :] * stride_qd, mask=row_valid[:, None] & (da[None, :] < DA),
                 other=0.0)
    if DB > 0:
        qb = tl.load(q_row + (DA + db[None, :]) * stride_qd,
                     mask=row_valid[:, None] & (db[None, :] < DB), other=0.0)
    lam = threshold_scale_factor / kv_len.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    n_skip = tl.full([], 0, tl.int32)
    for tile in range(tile_lo, tile_hi):
        j = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        in_walk = j < walk_len
        if SPARSE:
            sel = tl.load(IDX + kvh * stride_ih + start + j // SEL_BLOCK, mask=in_walk, other=-1)
            pos = sel * SEL_BLOCK + j % SEL_BLOCK
            valid = in_walk & (sel >= 0) & (pos < kv_len)
        else:
            pos = j
            valid = in_walk
        page = tl.load(BT + req * stride_bt + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        k_base = K + page * stride_kb + kvh * stride_kh + (pos % PAGE_SIZE) * stride_kp
        ka = tl.load(k_base[:, None] + da[None, :] * stride_kd,
                     mask=valid[:, None] & (da[None, :] < DA), other=0.0)
        s = dot(qa, tl.trans(ka), F32DOT)
        if DB > 0:
            kb = tl.load(k_base[:, None] + (DA + db[None, :]) * stride_kd,
                         mask=valid[:, None] & (db[None, :] < DB), other=0.0)
            s += dot(qb, tl.trans(kb), F32DOT)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        tile_max = tl.max(s, 1)
        compute = True
        if SKIP:
            compute = keep_tile(tile_max, m_i, lam, row_valid)
            n_skip += tl.where(compute, 0, 1)
        if compute:
            if V_IS_K:
                v = ka
            else:
                v_base = V + page * stride_vb + kvh * stride_vh + (pos % PAGE_SIZE) * stride_vp
                v = tl.load(v_base[:, None] + dv[None, :] * stride_vd,
                            mask=valid[:, None] & (dv[None, :] < DV), other=0.0)
            m_i, l_i, acc = softmax_tile(s, tile_max, m_i, l_i, acc, v, F32DOT)
    out, lse = finish_rows(acc, l_i, m_i)
    o_ptr = (O + t.to(tl.int64) * stride_ot + qh[:, None] * stride_oh + split * stride_os
             + dv[None, :] * stride_od)
    tl.store(o_ptr, out, mask=row_valid[:, None] & (dv[None, :] < DV))
    tl.store(LSE + t * stride_lt + qh * stride_lh + split * stride_ls, lse, mask=row_valid)
    if COUNT:
        tl.atomic_add(STATS, n_skip.to(STATS.dtype.element_ty))
        tl.atomic_add(STATS + 1, tl.maximum(tile_hi - tile_lo, 0).to(STATS.dtype.element_ty))


def launch_gather_attention(
    q: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, block_table: torch.Tensor,
    token_to_req: torch.Tensor, kv_lens: torch.Tensor, indices: torch.Tensor | None,
    offsets: torch.Tensor | None, block_size: int, sm_scale: float, threshold_scale_factor: float,
    stats: torch.Tensor | None, num_splits: int, *, group: int, block_h: int, da: int,
    dv: int, v_is_k: bool, block_n: int, num_warps: int, num_stages: int, interpret: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch :func:`gather_attn_fwd` (+ merge when ``num_splits > 1``); inputs pre-validated.

    ``k4``/``v4`` are ``[num_blocks, num_kv_heads, page_size, dim]`` views (any strides);
    ``q`` is ``[num_tokens, num_kv_heads * group, da + db]``. Returns ``(out, lse)``.
    """
    num_tokens, num_q_heads, dk = q.shape
    num_kv_heads, page_size = k4.shape[1], k4.shape[2]
    db = dk - da
    n_hblocks = -(-group // block_h)
    if num_splits > 1:
        o_buf = torch.empty(num_tokens, num_q_heads, num_splits, dv, dtype=torch.float32,
                            device=q.device)
    else:
        o_buf = torch.empty(num_tokens, num_q_heads, 1, dv, dtype=q.dtype, device=q.device)
    l_buf = torch.empty(num_tokens, num_q_heads, num_splits, dtype=torch.float32,
                        device=q.device)
    if num_tokens == 0 or num_q_heads == 0:
        return o_buf[:, :, 0], l_buf[:, :, 0]
    sparse = indices is not None
    idx = indices if sparse else block_table  # dummy pointer when dense
    off = offsets if sparse else kv_lens
    dummy_stats = stats if stats is not None else kv_lens
    grid = (num_tokens, num_kv_heads * n_hblocks, num_splits)
    gather_attn_fwd[grid](
        q, k4, v4, block_table, token_to_req, kv_lens, idx, off, o_buf, l_buf, dummy_stats,
        sm_scale * LOG2E, threshold_scale_factor, num_splits,
        *q.stride(), *k4.stride(), *v4.stride(), block_table.stride(0), idx.stride(0),
        *o_buf.stride(), *l_buf.stride(),
        GROUP=group, N_HBLOCKS=n_hblocks, PAGE_SIZE=page_size,
        SEL_BLOCK=block_size if sparse else 1, DA=da, DB=db, DV=dv,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_DA=next_pow2(max(da, 16)),
        BLOCK_DB=next_pow2(max(db, 16)), BLOCK_DV=next_pow2(max(dv, 16)),
        SPARSE=sparse, SKIP=threshold_scale_factor > 0, COUNT=stats is not None, V_IS_K=v_is_k,
        F32DOT=interpret, num_warps=num_warps, num_stages=num_stages)
    if num_splits > 1:
        return merge_states(o_buf, l_buf, out_dtype=q.dtype)
    return o_buf[:, :, 0], l_buf[:, :, 0]
