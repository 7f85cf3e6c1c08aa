"""Exact per-row top-k in Triton: ``radix`` (4 x 8-bit radix select) and ``gvr`` (Guess-Verify-
Refine, self-sampling). Contract, tie rule and references: ``naive.py`` (same signatures).

One program owns one row at a time and walks rows ``pid, pid + P, ...`` (``P`` programs), so
the GVR candidate scratch is ``[P, capacity]`` whatever the number of rows. Every pass streams
the row in ``BLOCK`` chunks: histograms with ``tl.histogram``, compaction with ``tl.cumsum``,
so positions come out ascending and the lowest positions win ties at the threshold.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .naive import GVR_BINS, GVR_SAMPLE, check_topk_args


@triton.jit
def _keys(x):
    """fp32 -> uint32 order-preserving key (``-0.0`` folded onto ``+0.0``)."""
    x = tl.where(x == 0.0, 0.0, x)
    b = x.to(tl.uint32, bitcast=True)
    return b ^ tl.where((b >> 31) != 0, 0xFFFFFFFF, 0x80000000).to(tl.uint32)


@triton.jit
def _load_keys(ROW, CK, offs, m, FROM_ROW: tl.constexpr):
    if FROM_ROW:
        return _keys(tl.load(ROW + offs, mask=m, other=0.0))
    return tl.load(CK + offs, mask=m, other=0).to(tl.uint32, bitcast=True)


@triton.jit
def _bins(key, lo, span, NUM_BINS: tl.constexpr):
    b = ((key - lo).to(tl.int64) * NUM_BINS) // span
    return tl.minimum(b, NUM_BINS - 1).to(tl.int32)


@triton.jit
def _radix_select(ROW, CK, n, k_rem, lo, span, b_sel,
                  FROM_ROW: tl.constexpr, FILTER: tl.constexpr, NUM_BINS: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Key of the ``k_rem``-th largest member and how many members equal to it to take.
    Members: the first ``n`` entries (row scores or scratch keys); with ``FILTER`` only those
    whose verify bin is ``b_sel``."""
    digits = tl.arange(0, 256)
    prefix = tl.zeros([1], tl.uint32)
    k_rem = tl.zeros([1], tl.int32) + k_rem
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros([256], tl.int32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n
            key = _load_keys(ROW, CK, offs, m, FROM_ROW)
            if FILTER:
                m = m & (_bins(key, lo, span, NUM_BINS) == b_sel)
            if p > 0:
                m = m & ((key >> (shift + 8)) == prefix)
            hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=m)
        ge = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # members with digit >= d
        d = tl.max(tl.where(ge >= k_rem, digits, -1), 0)
        k_rem = k_rem - tl.sum(tl.where(digits > d, hist, 0), 0)
        prefix = (prefix << 8) | d.to(tl.uint32)
    return prefix, k_rem


@triton.jit
def _block_select(keys, rank):
    """The ``rank``-th largest (0-based) of a register block of uint32 keys, 4 histogram passes."""
    digits = tl.arange(0, 256)
    prefix = tl.zeros([1], tl.uint32)
    k_rem = rank + 1
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        m = keys == keys
        if p > 0:
            m = (keys >> (shift + 8)) == prefix
        hist = tl.histogram(((keys >> shift) & 255).to(tl.int32), 256, mask=m)
        ge = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
        d = tl.max(tl.where(ge >= k_rem, digits, -1), 0)
        k_rem = k_rem - tl.sum(tl.where(digits > d, hist, 0), 0)
        prefix = (prefix << 8) | d.to(tl.uint32)
    return prefix


@triton.jit
def _emit(ROW, CK, CI, n, thr, need, OUT, K, FROM_ROW: tl.constexpr, BLOCK: tl.constexpr):
    """Write members with key > thr and the first ``need`` equal to thr, ascending; pad -1."""
    base = tl.zeros([1], tl.int32)
    eq_seen = tl.zeros([1], tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        key = _load_keys(ROW, CK, offs, m, FROM_ROW)
        is_eq = m & (key == thr)
        eq_rank = eq_seen + tl.cumsum(is_eq.to(tl.int32), 0) - 1
        take = m & ((key > thr) | (is_eq & (eq_rank < need)))
        dst = base + tl.cumsum(take.to(tl.int32), 0) - 1
        if FROM_ROW:
            pos = offs
        else:
            pos = tl.load(CI + offs, mask=m, other=-1)
        tl.store(OUT + dst, pos, mask=take)
        base += tl.sum(take.to(tl.int32), 0)
        eq_seen += tl.sum(is_eq.to(tl.int32), 0)
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(OUT + offs, tl.full([BLOCK], -1, tl.int32), mask=(offs >= base) & (offs < K))


@triton.jit
def radix_topk_kernel(S, LEN, OUT, STATS, rows, width, stride_s, stride_o, K,
                       BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):
    for r in range(tl.program_id(0), rows, tl.num_programs(0)):
        r64 = tl.zeros([1], tl.int64) + r  # 64-bit row offsets (the loop index is i32)
        row = S + r64 * stride_s
        out = OUT + r64 * stride_o
        n = tl.minimum(tl.maximum(tl.load(LEN + r), 0), width)  # a length past the row reads the row
        thr = tl.zeros([1], tl.uint32)
        need = tl.zeros([1], tl.int32) + n
        if n > K:
            thr, need = _radix_select(row, row, n, K, thr, 1, 0, True, False, NUM_BINS, BLOCK)
        _emit(row, row, LEN, n, thr, need, out, K, True, BLOCK)


@triton.jit
def gvr_topk_kernel(S, LEN, OUT, STATS, CKEY, CIDX, rows, width, stride_s, stride_o, K, capacity,
                     BLOCK: tl.constexpr, SAMPLE: tl.constexpr, NUM_BINS: tl.constexpr,
                     HAS_STATS: tl.constexpr):
    pid = tl.program_id(0)
    ck = CKEY + pid.to(tl.int64) * capacity
    ci = CIDX + pid.to(tl.int64) * capacity
    for r in range(pid, rows, tl.num_programs(0)):
        r64 = tl.zeros([1], tl.int64) + r
        row = S + r64 * stride_s
        out = OUT + r64 * stride_o
        n = tl.minimum(tl.maximum(tl.load(LEN + r), 0), width)
        fallback = 0
        if n <= K:
            _emit(row, row, LEN, n, tl.zeros([1], tl.uint32), tl.zeros([1], tl.int32) + n, out, K, True, BLOCK)
        else:
            # guess: strided sample of the current row; lo/hi = sample order statistics around
            # rank k*S/n, found by 256-bin histogram selects on the sample
            si = tl.arange(0, SAMPLE)
            sk = _keys(tl.load(row + (si.to(tl.int64) * n) // SAMPLE))
            rk = K * SAMPLE / n.to(tl.float32)
            margin = 3.0 * tl.sqrt(rk) + 4.0
            lo = _block_select(sk, tl.minimum(tl.ceil(rk + margin), SAMPLE - 1).to(tl.int32))
            hi = _block_select(sk, tl.maximum(tl.floor(rk - margin), 0.0).to(tl.int32))
            span = (hi - lo).to(tl.int64) + 1
            # verify: one pass, candidates key >= lo compacted to scratch, counted per bin
            hist = tl.zeros([NUM_BINS], tl.int32)
            cnt = tl.zeros([1], tl.int32)
            for start in range(0, n, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                key = _keys(tl.load(row + offs, mask=offs < n, other=float("-inf")))
                m = (offs < n) & (key >= lo)
                hist += tl.histogram(_bins(key, lo, span, NUM_BINS), NUM_BINS, mask=m)
                dst = cnt + tl.cumsum(m.to(tl.int32), 0) - 1
                ok = m & (dst < capacity)
                tl.store(ck + dst, key.to(tl.int32, bitcast=True), mask=ok)
                tl.store(ci + dst, offs, mask=ok)
                cnt += tl.sum(m.to(tl.int32), 0)
            tl.debug_barrier()
            total = tl.sum(cnt, 0)
            if (total >= K) & (total <= capacity):
                # refine: exact radix select among the crossing bin's candidates only
                bi = tl.arange(0, NUM_BINS)
                ge = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
                b = tl.max(tl.where(ge >= K, bi, -1), 0)
                above = tl.sum(tl.where(bi > b, hist, 0), 0)
                thr, need = _radix_select(ck, ck, total, K - above, lo, span, b, False, True,
                                          NUM_BINS, BLOCK)
                _emit(ck, ck, ci, total, thr, need, out, K, False, BLOCK)
            else:
                fallback = 1
                thr, need = _radix_select(row, row, n, K, lo, span, 0, True, False, NUM_BINS, BLOCK)
                _emit(row, row, LEN, n, thr, need, out, K, True, BLOCK)
            tl.debug_barrier()
        if HAS_STATS:
            tl.store(STATS + r, fallback)


def _out(scores: torch.Tensor, k: int, out: torch.Tensor | None) -> torch.Tensor:
    rows = scores.shape[0]
    if out is None:
        return torch.empty(rows, k, dtype=torch.int32, device=scores.device)
    check_out = out.dtype == torch.int32 and tuple(out.shape) == (rows, k) and out.stride(1) == 1
    if not check_out or out.device != scores.device:
        raise ValueError(f"out: expected an int32 [{rows}, {k}] tensor with unit column stride on {scores.device}")
    return out


def radix_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int, *, block: int,
               num_programs: int, num_warps: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton ``radix`` engine; arguments and result as ``naive.radix_topk`` (``block``,
    ``num_programs``, ``num_warps`` come from ``plan.topk_launch``)."""
    check_topk_args(scores, lengths, k)
    res = _out(scores, k, out)
    rows = scores.shape[0]
    if rows:
        grid = (max(1, min(rows, num_programs)),)
        radix_topk_kernel[grid](scores, lengths, res, res, rows, scores.shape[1], scores.stride(0), res.stride(0), k,
                                 BLOCK=block, NUM_BINS=GVR_BINS, num_warps=num_warps)
    return res


def gvr_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int, capacity: int, *,
             workspace: torch.Tensor, block: int, num_warps: int, stats: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton ``gvr`` engine; as ``naive.gvr_topk``. ``workspace [2, P, capacity]`` int32 is the
    candidate scratch of ``P`` persistent programs (``plan.TopKWorkspace``)."""
    check_topk_args(scores, lengths, k)
    if capacity < k:
        raise ValueError(f"capacity: expected >= k={k}, got {capacity}")
    if workspace.dtype != torch.int32 or workspace.dim() != 3 or workspace.shape[0] != 2 \
            or workspace.shape[2] != capacity or not workspace.is_contiguous():
        raise ValueError(f"workspace: expected a contiguous int32 [2, programs, capacity={capacity}] tensor, "
                         f"got {workspace.dtype} {tuple(workspace.shape)}")
    if stats is not None and (stats.dtype != torch.int32 or stats.shape != (scores.shape[0],)):
        raise ValueError(f"stats: expected int32 [{scores.shape[0]}], got {stats.dtype} {tuple(stats.shape)}")
    res = _out(scores, k, out)
    rows = scores.shape[0]
    if rows:
        grid = (max(1, min(rows, workspace.shape[1])),)
        gvr_topk_kernel[grid](scores, lengths, res, stats if stats is not None else res, workspace[0],
                               workspace[1], rows, scores.shape[1], scores.stride(0), res.stride(0), k, capacity,
                               BLOCK=block, SAMPLE=GVR_SAMPLE, NUM_BINS=GVR_BINS,
                               HAS_STATS=stats is not None, num_warps=num_warps)
    return res
