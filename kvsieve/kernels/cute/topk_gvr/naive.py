"""Plain-PyTorch reference of the CuTe :func:`~kvsieve.kernels.cute.topk_gvr.gvr_topk` (same
arguments and result): the exact top-k every engine must equal — ascending positions, the lowest
position winning ties at the threshold, ``-1`` past a row's length. The step-by-step transcription
of the kernel's algorithm is :mod:`.mirror`; this is the answer it must give."""
from __future__ import annotations

import torch

from ...triton.topk.naive import radix_topk

__all__ = ["gvr_topk"]


def gvr_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int, out: torch.Tensor | None = None
             ) -> torch.Tensor:
    """``scores [rows, width]`` fp32, ``lengths [rows]`` -> int32 ``[rows, k]`` (into ``out`` if given)."""
    result = radix_topk(scores, lengths, k)
    if out is None:
        return result
    return out.copy_(result)
