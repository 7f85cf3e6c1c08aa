"""PyTorch transcription of the CuTe-DSL GVR kernel (``device.py``), step for step, for CPU
tests of the algorithm: the same sample positions, the same fp32 rank arithmetic, the same
shift binning, the same scratch capacity and crossing rule, the same fallback condition. It
returns what the kernel returns (positions and the fallback flags), so its agreement with
``kvsieve.kernels.topk.naive.radix_topk`` shows the algorithm exact; that the DSL code
implements it is checked only by the GPU tests.
"""
from __future__ import annotations

import math

import torch

from ..naive import check_topk_args, ordered_keys
from .params import BINS, SAMPLE, capacity_for

__all__ = ["gvr_topk_mirror", "guess_ranks"]


def guess_ranks(n: int, k: int) -> tuple[int, int]:
    """Sample ranks (0-based, descending) of ``lo`` and ``hi``, in the kernel's fp32 arithmetic."""
    f = torch.float32
    rk = torch.tensor(k * SAMPLE, dtype=f) / torch.tensor(n, dtype=f)
    margin = torch.tensor(3.0, dtype=f) * torch.sqrt(rk) + torch.tensor(4.0, dtype=f)
    x_lo = float(rk + margin)
    r_lo = min(math.ceil(x_lo), SAMPLE - 1)
    r_hi = max(int(float(rk - margin)), 0)  # truncation, as the kernel's int conversion
    return r_lo, r_hi


def _emit(keys: torch.Tensor, pos: torch.Tensor, thr: int, need: int, k: int) -> torch.Tensor:
    eq = keys == thr
    take = (keys > thr) | (eq & (eq.cumsum(0) - 1 < need))
    sel = pos[take]
    out = torch.full((k,), -1, dtype=torch.int32)
    out[:sel.numel()] = sel.to(torch.int32)
    return out


def _select(keys: torch.Tensor, k_rem: int) -> tuple[int, int]:
    """Key of the ``k_rem``-th largest and how many equal to it to take."""
    thr = int(keys.sort(descending=True).values[k_rem - 1])
    return thr, k_rem - int((keys > thr).sum())


def gvr_topk_mirror(scores: torch.Tensor, lengths: torch.Tensor, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [rows, k] int32, fallback [rows] int32)`` as the kernel computes them."""
    check_topk_args(scores, lengths, k)
    rows, width = scores.shape
    cap = capacity_for(k)
    out = torch.full((rows, k), -1, dtype=torch.int32)
    fb = torch.zeros(rows, dtype=torch.int32)
    for r in range(rows):
        n = min(int(lengths[r]), width)
        if n <= k:
            out[r, :max(n, 0)] = torch.arange(max(n, 0), dtype=torch.int32)
            continue
        keys = ordered_keys(scores[r, :n].cpu()) - 2 ** 31  # signed order keys
        pos = torch.arange(n)
        samp = keys[torch.arange(SAMPLE) * n // SAMPLE].sort(descending=True).values
        r_lo, r_hi = guess_ranks(n, k)
        lo, hi = int(samp[r_lo]), int(samp[r_hi])
        diff = hi - lo
        sh = 0
        for s in range(25):
            if (diff >> s) >= BINS:
                sh = s + 1
        cand = keys >= lo
        cnt = int(cand.sum())
        if k <= cnt <= cap:
            ck, cp = keys[cand], pos[cand]
            bins = torch.clamp((ck - lo) >> sh, max=BINS - 1)
            hist = torch.bincount(bins, minlength=BINS)
            ge = hist.flip(0).cumsum(0).flip(0)
            b = int(torch.nonzero(ge >= k).max())
            k_in_bin = k - int(ge[b] - hist[b])
            thr, need = _select(ck[bins == b], k_in_bin)
            out[r] = _emit(ck, cp, thr, need, k)
        else:
            fb[r] = 1
            thr, need = _select(keys, k)
            out[r] = _emit(keys, pos, thr, need, k)
    return out, fb
