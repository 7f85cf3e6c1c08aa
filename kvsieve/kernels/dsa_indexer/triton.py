"""DSA lightning-indexer logits in Triton: ragged prefill and paged decode (one kernel).

One program handles one query token and ``BLOCK_N`` key positions: it loads the token's
``[n_heads, D]`` index query once, gathers a ``[BLOCK_N, D]`` key tile (contiguous rows for
prefill, through the block table for decode), computes ``ReLU(q k^T)`` with the heads as the
MMA's M side, reduces over heads with the fp32 weights, multiplies the per-key FP8 scale, and
writes ``-inf`` past the row's causal length. Math and contract: ``naive.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import launch
from ..common.checks import next_pow2
from .plan import INDEXER_LAUNCH, check_decode_args, check_prefill_args

__all__ = ["indexer_logits_prefill", "indexer_logits_decode"]


@triton.jit
def indexer_logits_kernel(
    Q, K, KS, W, BT, TOK2REQ, KSTART, KLEN, O,
    stride_qt, stride_qh, stride_kb, stride_kp, stride_ksb, stride_wt, stride_bt, stride_ot,
    H: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, HAS_SCALE: tl.constexpr,
    F32DOT: tl.constexpr,
):
    t = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    t64 = t.to(tl.int64)
    kv_len = tl.load(KLEN + t)
    j = n0 + tl.arange(0, BLOCK_N)
    valid = j < kv_len
    out = tl.full([BLOCK_N], float("-inf"), tl.float32)
    if n0 < kv_len:
        hh = tl.arange(0, BLOCK_H)
        dd = tl.arange(0, BLOCK_D)
        q = tl.load(Q + t64 * stride_qt + hh[:, None] * stride_qh + dd[None, :],
                    mask=(hh[:, None] < H) & (dd[None, :] < D), other=0.0)
        w = tl.load(W + t64 * stride_wt + hh, mask=hh < H, other=0.0)
        if PAGED:
            req = tl.load(TOK2REQ + t).to(tl.int64)
            blk = tl.load(BT + req * stride_bt + j // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
            krow = blk * stride_kb + (j % PAGE_SIZE) * stride_kp
            srow = blk * stride_ksb + (j % PAGE_SIZE)
        else:
            krow = (tl.load(KSTART + t) + j).to(tl.int64) * stride_kb
            srow = (tl.load(KSTART + t) + j).to(tl.int64)
        k = tl.load(K + krow[:, None] + dd[None, :], mask=valid[:, None] & (dd[None, :] < D), other=0.0)
        if F32DOT:  # the interpreter multiplies bf16 bits as integers (triton#11584)
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        logits = tl.sum(tl.maximum(s, 0.0) * w[:, None], 0)
        if HAS_SCALE:
            logits = logits * tl.load(KS + srow, mask=valid, other=1.0)
        out = tl.where(valid, logits, float("-inf"))
    tl.store(O + t64 * stride_ot + j, out, mask=j < stride_ot)


def _launch(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor | None, weights: torch.Tensor,
            block_table: torch.Tensor, token_to_req: torch.Tensor, k_start: torch.Tensor, k_len: torch.Tensor,
            width: int, paged: bool) -> torch.Tensor:
    t, h, d = q.shape
    out = torch.empty(t, width, dtype=torch.float32, device=q.device)
    if t == 0 or width == 0:
        return out
    arch = launch.detect_arch(q.device)
    cfg = INDEXER_LAUNCH[arch]
    if paged:
        stride_kb, stride_kp = k.stride(0), k.stride(1)
        stride_ksb = k_scale.stride(0) if k_scale is not None else 0
        page = k.shape[1]
    else:
        stride_kb, stride_kp, stride_ksb, page = k.stride(0), 0, 0, 1
    grid = (t, triton.cdiv(width, cfg.block_n))
    indexer_logits_kernel[grid](
        q, k, k_scale if k_scale is not None else weights, weights, block_table, token_to_req, k_start, k_len, out,
        q.stride(0), q.stride(1), stride_kb, stride_kp, stride_ksb, weights.stride(0), block_table.stride(0),
        out.stride(0),
        H=h, D=d, PAGE_SIZE=page, BLOCK_H=max(16, next_pow2(h)), BLOCK_D=max(16, next_pow2(d)),
        BLOCK_N=cfg.block_n, PAGED=paged, HAS_SCALE=k_scale is not None, F32DOT=arch == "interpreter",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def indexer_logits_prefill(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor | None, weights: torch.Tensor,
                           k_start: torch.Tensor, k_len: torch.Tensor, width: int) -> torch.Tensor:
    """Triton ragged prefill logits; arguments and result as ``naive.indexer_logits_prefill``."""
    check_prefill_args(q, k, k_scale, weights, k_start, k_len, width)
    return _launch(q, k, k_scale, weights, k_start.view(1, -1), k_start, k_start, k_len, width, paged=False)


def indexer_logits_decode(q: torch.Tensor, k_cache: torch.Tensor, k_scale_cache: torch.Tensor | None,
                          weights: torch.Tensor, block_table: torch.Tensor, token_to_req: torch.Tensor,
                          kv_lens: torch.Tensor, width: int) -> torch.Tensor:
    """Triton paged decode logits; arguments and result as ``naive.indexer_logits_decode``."""
    check_decode_args(q, k_cache, k_scale_cache, weights, block_table, token_to_req, kv_lens, width)
    return _launch(q, k_cache, k_scale_cache, weights, block_table, token_to_req, kv_lens, kv_lens, width,
                   paged=True)
