"""Plain-PyTorch references of the top-k engines (same signature, same result as the kernels).

Contract shared by every engine (``torch``, ``radix``, ``gvr`` and the CuTe-DSL GVR):

* ``scores [rows, width]`` fp32, ``lengths [rows]`` int32: row ``r`` ranks
  ``scores[r, :lengths[r]]`` (``0 <= lengths[r] <= width``); entries past the length are never
  read as candidates. ``-inf`` is an ordinary (lowest) value; NaN is not supported.
* Result ``[rows, k]`` int32 column positions; a row with ``lengths[r] <= k`` returns
  ``0 .. lengths[r]-1`` then ``-1`` padding.
* The selected *value multiset* equals ``torch.topk(scores[r, :n], min(k, n))``'s.
* ``radix`` and ``gvr`` (kernel and reference) are deterministic: positions come out in
  ascending order, and among entries equal to the k-th largest value the lowest positions are
  kept (tie rule). ``-0.0`` and ``+0.0`` are one value. The ``torch`` engine keeps the same
  positions (in descending score order). So no engine's choice depends on the row's width: a query
  selects the same positions whatever else shares its step (chunked prefill, batching).
"""
from __future__ import annotations

import math

import torch

from ..common.checks import check_positive_int, check_tensor

__all__ = ["ordered_keys", "torch_topk", "radix_topk", "gvr_topk", "gvr_thresholds", "check_topk_args",
           "GVR_SAMPLE", "GVR_BINS"]

GVR_SAMPLE = 1024  # sample size of the guess step (kernel constexpr, same value)
GVR_BINS = 256  # bins of the verify histogram
_RADIX_BITS = 8


def check_topk_args(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> None:
    """Shape/dtype validation shared by every engine (no device sync)."""
    check_tensor("scores", scores, 2, (torch.float32,))
    check_tensor("lengths", lengths, 1, (torch.int32,), scores.device)
    check_positive_int("k", k)
    if lengths.numel() != scores.shape[0]:
        raise ValueError(f"lengths: expected {scores.shape[0]} entries (one per row), got {lengths.numel()}")
    if scores.shape[1] > 0 and scores.stride(1) != 1:
        raise ValueError("scores: expected a unit stride along the row")


def ordered_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 ``[...]`` in ``[0, 2**32)``: an order-preserving map of fp32 values (``-0.0`` folded
    onto ``+0.0``); larger value <=> larger key. The kernels compute the same uint32."""
    x = torch.where(scores == 0, torch.zeros_like(scores), scores)
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits ^ 0xFFFFFFFF, bits | 0x80000000)


def torch_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """The ``torch`` engine: ``torch.topk`` per row over the valid prefix, ``-1`` padded; a
    row of ``length <= k`` gives ``0..n-1`` (the contract of every engine). Equal scores rank the
    lower position first (the native decode kernel's rule too): each valid score's
    :func:`ordered_keys` is joined with ``2**31 - 1 - position`` into one int64 key, invalid
    positions rank last."""
    check_topk_args(scores, lengths, k)
    rows, width = scores.shape
    out = torch.full((rows, k), -1, dtype=torch.int32, device=scores.device)
    if rows == 0 or width == 0:
        return out
    kk = min(k, width)
    lens = lengths.to(torch.int64).clamp(0, width)
    pos = torch.arange(width, device=scores.device)
    valid = pos < lens.unsqueeze(1)
    keys = torch.where(valid, ordered_keys(scores) * 2**31 + (2**31 - 1 - pos), -1)
    top, idx = keys.topk(kk, dim=1)
    out[:, :kk] = torch.where(top >= 0, idx, -1).to(torch.int32)
    short = lens <= k
    out[short, :kk] = torch.where(pos[:kk] < lens[short].unsqueeze(1), pos[:kk], -1).to(torch.int32)
    return out


def _threshold(keys: torch.Tensor, member: torch.Tensor, k_rem: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Radix select, 8-bit digits from the top: per row the key ``T`` of the ``k_rem``-th largest
    member key and how many members equal to ``T`` are taken (``need``). keys/member
    ``[rows, n]``; ``k_rem [rows]`` int64 (``1 <= k_rem <= members``)."""
    rows = keys.shape[0]
    prefix = torch.zeros(rows, dtype=torch.int64, device=keys.device)
    k_rem = k_rem.clone()
    bins = torch.arange(1 << _RADIX_BITS, device=keys.device)
    for shift in range(32 - _RADIX_BITS, -1, -_RADIX_BITS):
        m = member & ((keys >> (shift + _RADIX_BITS)) == prefix.unsqueeze(1)) if shift < 32 - _RADIX_BITS else member
        digit = (keys >> shift) & 0xFF
        hist = torch.zeros(rows, 1 << _RADIX_BITS, dtype=torch.int64, device=keys.device)
        hist.scatter_add_(1, digit, m.to(torch.int64))
        ge = hist.flip(1).cumsum(1).flip(1)  # members with digit >= b
        d = torch.where(ge >= k_rem.unsqueeze(1), bins, -1).max(1).values
        k_rem -= (hist * (bins > d.unsqueeze(1))).sum(1)
        prefix = (prefix << _RADIX_BITS) | d
    return prefix, k_rem


def _emit(keys: torch.Tensor, member: torch.Tensor, thr: torch.Tensor, need: torch.Tensor, k: int) -> torch.Tensor:
    """Members with key > thr, plus the first ``need`` members equal to thr, ascending, -1 padded."""
    eq = member & (keys == thr.unsqueeze(1))
    eq_rank = eq.to(torch.int64).cumsum(1) - 1
    take = member & ((keys > thr.unsqueeze(1)) | (eq & (eq_rank < need.unsqueeze(1))))
    n = keys.shape[1]
    pos = torch.arange(n, device=keys.device).expand_as(take)
    order = torch.where(take, pos, n).sort(dim=1).values[:, :k]
    out = torch.where(order < n, order, -1).to(torch.int32)
    if out.shape[1] < k:
        out = torch.nn.functional.pad(out, (0, k - out.shape[1]), value=-1)
    return out


def radix_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Reference of the ``radix`` kernel: exact, ascending positions, lowest positions win ties."""
    check_topk_args(scores, lengths, k)
    rows, width = scores.shape
    if rows == 0 or width == 0:
        return torch.full((rows, k), -1, dtype=torch.int32, device=scores.device)
    lens = lengths.to(torch.int64).clamp(0, width)  # a length past the row reads the row
    keys = ordered_keys(scores)
    valid = torch.arange(width, device=scores.device) < lens.unsqueeze(1)
    short = lens <= k
    k_rem = torch.where(short, torch.ones_like(lens), torch.full_like(lens, k))
    thr, need = _threshold(keys, valid & ~short.unsqueeze(1), k_rem)
    thr = torch.where(short, torch.zeros_like(thr), thr)  # short rows: every valid entry is taken
    need = torch.where(short, lens, need)
    return _emit(keys, valid, thr, need, k)


def gvr_thresholds(sample_keys: torch.Tensor, n: int, k: int) -> tuple[int, int]:
    """Guess step: ``(lo, hi)`` keys from the descending-sorted sample of a row of ``n > k``.

    The k-th largest entry sits near sample rank ``r = k * S / n``; ``lo`` is taken
    ``3 sqrt(r) + 4`` ranks below (so the verify pass most likely finds >= k candidates),
    ``hi`` as far above (the upper anchor of the bins)."""
    s = sample_keys.numel()
    r = k * s / n
    margin = 3.0 * math.sqrt(r) + 4.0
    r_lo = min(s - 1, math.ceil(r + margin))
    r_hi = max(0, math.floor(r - margin))
    return int(sample_keys[r_lo]), int(sample_keys[r_hi])


def gvr_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int, capacity: int,
             stats: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of the ``gvr`` kernel (Guess-Verify-Refine, self-sampling), row by row.

    Guess: a strided sample of ``GVR_SAMPLE`` entries of the current row gives ``lo``/``hi``
    (:func:`gvr_thresholds`). Verify: one pass keeps the candidates ``key >= lo`` (at most
    ``capacity``, in position order) and counts them in ``GVR_BINS`` bins spanning ``[lo, hi]``
    (keys above ``hi`` in the top bin); a suffix scan gives exact counts at every bin boundary
    and the crossing bin. Refine: a radix select among the crossing bin's candidates only. A
    guess that yields fewer than ``k`` or more than ``capacity`` candidates falls back to a
    radix select over the whole row (``stats[r] = 1``). The result equals :func:`radix_topk`.
    """
    check_topk_args(scores, lengths, k)
    check_positive_int("capacity", capacity)
    if capacity < k:
        raise ValueError(f"capacity: expected >= k={k}, got {capacity}")
    rows, width = scores.shape
    out = torch.full((rows, k), -1, dtype=torch.int32, device=scores.device)
    if stats is not None:
        stats.zero_()
    for r in range(rows):
        n = min(max(int(lengths[r]), 0), width)
        if n <= k:
            out[r, :n] = torch.arange(n, dtype=torch.int32, device=scores.device)
            continue
        keys = ordered_keys(scores[r, :n])
        pos = torch.arange(GVR_SAMPLE, dtype=torch.int64, device=scores.device) * n // GVR_SAMPLE
        lo, hi = gvr_thresholds(keys[pos].sort(descending=True).values, n, k)
        cand = torch.nonzero(keys >= lo).flatten()
        if not k <= cand.numel() <= capacity:
            if stats is not None:
                stats[r] = 1
            out[r] = radix_topk(scores[r:r + 1, :n].contiguous(), lengths[r:r + 1].clamp(max=n), k)[0]
            continue
        ck = keys[cand]
        bins = torch.clamp((ck - lo) * GVR_BINS // (hi - lo + 1), max=GVR_BINS - 1)
        hist = torch.bincount(bins, minlength=GVR_BINS)
        ge = hist.flip(0).cumsum(0).flip(0)
        b = int(torch.nonzero(ge >= k).max())
        above = int(ge[b] - hist[b])
        thr, need = _threshold(ck.unsqueeze(0), (bins == b).unsqueeze(0),
                               torch.tensor([k - above], device=scores.device))
        sel = _emit(ck.unsqueeze(0), torch.ones_like(ck, dtype=torch.bool).unsqueeze(0), thr, need, k)[0]
        out[r] = torch.where(sel >= 0, cand[sel.clamp(min=0).long()], -1).to(torch.int32)
    return out
