"""Paged (chunked) prefill attention in Triton: dense query tiles or per-token sparse gather."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.checks import next_pow2
from ..common.gather.plan import plan_gqa_gather
from ..common.gather.triton import LOG2E, dot, finish_rows, keep_tile, launch_gather_attention, softmax_tile
from .plan import plan_dense_prefill, query_tiles, select_prefill_path


@triton.jit
def prefill_fwd(
    Q, K, V, BT, TOK2REQ, KVLEN, TSTART, TCOUNT, O, LSE, STATS, qk_scale, threshold_scale_factor,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kp, stride_kd,
    stride_vb, stride_vh, stride_vp, stride_vd,
    stride_bt, stride_ot, stride_oh, stride_od, stride_lt, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
    DA: tl.constexpr, DB: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DA: tl.constexpr,
    BLOCK_DB: tl.constexpr, BLOCK_DV: tl.constexpr,
    SKIP: tl.constexpr, COUNT: tl.constexpr, F32DOT: tl.constexpr,
):
    # Rows of the tile: token-major, GROUP_PAD heads per token.
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    t0 = tl.load(TSTART + tile)
    cnt = tl.load(TCOUNT + tile)
    req = tl.load(TOK2REQ + t0).to(tl.int64)
    r = tl.arange(0, BLOCK_M)
    g = r % GROUP_PAD
    row_valid = (r // GROUP_PAD < cnt) & (g < GROUP)
    tok = (t0 + r // GROUP_PAD).to(tl.int64)
    qh = kvh * GROUP + g
    kv_len = tl.load(KVLEN + tok, mask=row_valid, other=0)
    max_len = tl.max(kv_len, 0)
    da = tl.arange(0, BLOCK_DA)
    db = tl.arange(0, BLOCK_DB)
    dv = tl.arange(0, BLOCK_DV)
    q_row = Q + tok[:, None] * stride_qt + qh[:, None] * stride_qh
    qa = tl.load(q_row + da[None, :] * stride_qd, mask=row_valid[:, None] & (da[None, :] < DA),
                 other=0.0)
    if DB > 0:
        qb = tl.load(q_row + (DA + db[None, :]) * stride_qd,
                     mask=row_valid[:, None] & (db[None, :] < DB), other=0.0)
    lam = threshold_scale_factor / tl.maximum(kv_len, 1).to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    n_skip = tl.full([], 0, tl.int32)
    n_tiles = tl.cdiv(max_len, BLOCK_N)
    for kt in range(0, n_tiles):
        pos = kt * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = pos < max_len
        page = tl.load(BT + req * stride_bt + pos // PAGE_SIZE, mask=col_ok, other=0)
        page = page.to(tl.int64)
        k_base = K + page * stride_kb + kvh * stride_kh + (pos % PAGE_SIZE) * stride_kp
        ka = tl.load(k_base[:, None] + da[None, :] * stride_kd,
                     mask=col_ok[:, None] & (da[None, :] < DA), other=0.0)
        s = dot(qa, tl.trans(ka), F32DOT)
        if DB > 0:
            kb = tl.load(k_base[:, None] + (DA + db[None, :]) * stride_kd,
                         mask=col_ok[:, None] & (db[None, :] < DB), other=0.0)
            s += dot(qb, tl.trans(kb), F32DOT)
        s = tl.where(pos[None, :] < kv_len[:, None], s * qk_scale, float("-inf"))
        tile_max = tl.max(s, 1)
        compute = True
        if SKIP:
            compute = keep_tile(tile_max, m_i, lam, row_valid)
            n_skip += tl.where(compute, 0, 1)
        if compute:
            v_base = V + page * stride_vb + kvh * stride_vh + (pos % PAGE_SIZE) * stride_vp
            v = tl.load(v_base[:, None] + dv[None, :] * stride_vd,
                        mask=col_ok[:, None] & (dv[None, :] < DV), other=0.0)
            m_i, l_i, acc = softmax_tile(s, tile_max, m_i, l_i, acc, v, F32DOT)
    out, lse = finish_rows(acc, l_i, m_i)
    tl.store(O + tok[:, None] * stride_ot + qh[:, None] * stride_oh + dv[None, :] * stride_od,
             out, mask=row_valid[:, None] & (dv[None, :] < DV))
    tl.store(LSE + tok * stride_lt + qh * stride_lh, lse, mask=row_valid)
    if COUNT:
        tl.atomic_add(STATS, n_skip.to(STATS.dtype.element_ty))
        tl.atomic_add(STATS + 1, n_tiles.to(STATS.dtype.element_ty))


def paged_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    token_to_req: torch.Tensor, kv_lens: torch.Tensor, indices: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None, block_size: int = 1, sm_scale: float | None = None,
    threshold_scale_factor: float = 0.0, stats: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill / chunked-prefill attention over a paged GQA cache.

    Arguments, shapes, dtypes and the ``(out, lse)`` result are those of
    ``sparse_gqa_decode``; ``kv_lens[t]`` is the causal limit of token ``t`` (its position + 1,
    including cached context). ``select_prefill_path(indices)`` names the path that runs:

    * ``"dense_tiled"`` (``indices is None``): one program per (query tile, KV head); a query
      tile is up to ``block_m // group_pad`` consecutive tokens of one request x the padded GQA
      group; KV tiles up to the tile's longest ``kv_lens`` are read once for all its rows and
      masked per row. The query tiling (``query_tiles``) reads ``token_to_req`` on the host
      (one device sync). ``num_splits`` must be None or 1 on this path.
    * ``"sparse_gather"``: each token attends its own selection (gather kernel, split-K).

    Skip-softmax and ``stats`` work on both paths (on the dense path the rule covers every
    row of the query tile, each with its own ``lambda = factor / kv_lens[t]``).
    """
    base = plan_gqa_gather(q, k_cache, v_cache, block_table, token_to_req, kv_lens, indices,
                           offsets, block_size, sm_scale, threshold_scale_factor, stats,
                           num_splits if indices is not None else 1)
    if select_prefill_path(indices) == "sparse_gather":
        return launch_gather_attention(
            q, k_cache, v_cache, block_table, token_to_req, kv_lens, indices, offsets,
            block_size, base.sm_scale, base.threshold_scale_factor, stats, base.num_splits,
            group=base.group, block_h=base.block_h, da=base.da, dv=base.dv, v_is_k=False,
            block_n=base.block_n, num_warps=base.num_warps, num_stages=base.num_stages,
            interpret=base.arch == "interpreter")
    if num_splits not in (None, 1):
        raise ValueError(f"num_splits: the dense_tiled prefill path takes None or 1, "
                         f"got {num_splits!r}")
    p = plan_dense_prefill(q, k_cache.shape[1], v_cache.shape[3], sm_scale,
                           threshold_scale_factor)
    num_tokens, num_q_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_q_heads, p.dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(num_tokens, num_q_heads, dtype=torch.float32, device=q.device)
    if num_tokens == 0:
        return out, lse
    t_start, t_count = query_tiles(token_to_req, p.tokens_per_tile)
    db = head_dim - p.da
    prefill_fwd[(t_start.numel(), k_cache.shape[1])](
        q, k_cache, v_cache, block_table, token_to_req, kv_lens, t_start, t_count, out, lse,
        stats if stats is not None else kv_lens, p.sm_scale * LOG2E, p.threshold_scale_factor,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_table.stride(0),
        *out.stride(), *lse.stride(),
        GROUP=p.group, GROUP_PAD=p.group_pad, PAGE_SIZE=k_cache.shape[2], DA=p.da, DB=db,
        DV=p.dv, BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_DA=max(16, p.da),
        BLOCK_DB=next_pow2(max(db, 16)), BLOCK_DV=next_pow2(max(p.dv, 16)),
        SKIP=p.threshold_scale_factor > 0, COUNT=stats is not None, F32DOT=p.arch == "interpreter",
        num_warps=p.num_warps, num_stages=p.num_stages)
    return out, lse
