"""What the native kernels over runs of a paged cache share (``sparse_gqa_decode``'s decode rows,
``prompt_runs``'s prompt rows): the runs themselves (:class:`TokenRuns`, built by
:func:`kvsieve.kernels.sparse_gqa_decode.runs.selection_runs`) and the arrays a kernel call takes
(:func:`runs_call_inputs`)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["TokenRuns", "runs_call_inputs"]


@dataclass(frozen=True)
class TokenRuns:
    """Runs of consecutive cache positions inside one cache block, grouped by (KV head, row):
    the runs of row ``n`` and KV head ``h`` are ``[ptr[h * num_rows + n], ptr[h * num_rows + n + 1])``,
    in ascending position order.

    ``ptr [Hkv * num_rows + 1]`` int64; per run ``block`` (physical cache block), ``head`` (its KV
    head), ``start`` (first token inside the block) int64 ``[R]`` and ``cnt`` (tokens) int32 ``[R]``;
    ``attended [num_rows, Hkv]`` int64: the positions each (row, KV head) reads (the sum of its runs)."""

    ptr: np.ndarray
    block: np.ndarray
    head: np.ndarray
    start: np.ndarray
    cnt: np.ndarray
    attended: np.ndarray

    @property
    def num_rows(self) -> int:
        return self.attended.shape[0]


def runs_call_inputs(k: torch.Tensor, v: torch.Tensor, runs: TokenRuns, q: torch.Tensor) -> tuple:
    """What a native kernel over runs takes besides the views, and where it writes:
    ``(k_off, v_off, k_ch, cnt, qf, out, lse)``: the runs' first tokens as element offsets into ``k``/``v
    [num_blocks, Hkv, block_size, D]`` (int64 ``[R]`` each), K's channel stride where K is stored by
    channel (``0``: rows of ``D``), the runs' counts int32 ``[R]``, q ``[N, Hq, D]`` as contiguous fp32,
    and the empty fp32 ``out [N, Hq, D]`` and ``lse [N, Hq]``."""
    sk, sv = k.stride(), v.stride()
    k_off = runs.block * sk[0] + runs.head * sk[1] + runs.start * sk[2]
    v_off = runs.block * sv[0] + runs.head * sv[1] + runs.start * sv[2]
    k_ch = 0 if sk[3] == 1 and sk[2] == k.shape[3] else sk[3]
    n, hq, d = q.shape
    return (k_off, v_off, k_ch, np.ascontiguousarray(runs.cnt, dtype=np.int32), q.to(torch.float32).contiguous(),
            torch.empty(n, hq, d, dtype=torch.float32), torch.empty(n, hq, dtype=torch.float32))
