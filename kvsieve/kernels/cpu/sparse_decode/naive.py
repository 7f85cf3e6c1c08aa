"""Plain-PyTorch references of :func:`~kvsieve.kernels.cpu.sparse_decode.sparse_decode_native` and
:func:`~kvsieve.kernels.cpu.sparse_decode.sparse_decode_runs_native` (the contract is in the
package docstring): gather the runs, mask, softmax."""
from __future__ import annotations

import numpy as np
import torch

from .runs import TokenRuns

__all__ = ["sparse_decode_naive", "sparse_decode_runs_naive"]


def sparse_decode_naive(rows: torch.Tensor, k_rows: torch.Tensor, cnt: torch.Tensor, v_offset: int, q: torch.Tensor,
                        *, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [Hq, D] fp32, lse [Hq] fp32)``."""
    hkv, n_runs = k_rows.shape
    d = q.shape[1]
    unit = rows.shape[1] // d
    k = rows[k_rows.flatten()].view(hkv, n_runs * unit, d).float()
    v = rows[(k_rows + v_offset).flatten()].view(hkv, n_runs * unit, d).float()
    valid = (torch.arange(unit) < cnt.unsqueeze(-1)).view(hkv, 1, -1)  # [Hkv, 1, U*unit]
    s = torch.matmul(q.float().view(hkv, -1, d), k.transpose(-1, -2)) * sm_scale  # [Hkv, G, U*unit]
    s = s.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hkv, G]
    empty = torch.isneginf(lse)
    out = torch.matmul(torch.exp(s - torch.where(empty, 0.0, lse).unsqueeze(-1)), v)
    out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out.reshape(-1, d), torch.where(empty, torch.inf, lse).reshape(-1)


def sparse_decode_runs_naive(k: torch.Tensor, v: torch.Tensor, runs: TokenRuns, q: torch.Tensor, *, sm_scale: float
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [N, Hq, D] fp32, lse [N, Hq] fp32)``: per (row, KV head) its runs' tokens gathered from
    ``k``/``v [num_blocks, Hkv, block_size, D]`` (any strides), softmax in fp32."""
    n_rows, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = torch.zeros(n_rows, hq, d, dtype=torch.float32)
    lse = torch.full((n_rows, hq), torch.inf, dtype=torch.float32)
    for h in range(hkv):
        for n in range(n_rows):
            a, b = int(runs.ptr[h * n_rows + n]), int(runs.ptr[h * n_rows + n + 1])
            cnt = runs.cnt[a:b].astype(np.int64)
            if not cnt.sum():
                continue
            blocks = torch.from_numpy(np.repeat(runs.block[a:b], cnt))
            tok = torch.from_numpy(np.repeat(runs.start[a:b] - np.cumsum(cnt) + cnt, cnt) + np.arange(cnt.sum()))
            keys, vals = k[blocks, h, tok].float(), v[blocks, h, tok].float()  # [L, D]
            s = q[n, h * g:(h + 1) * g].float() @ keys.T * sm_scale  # [G, L]
            lse[n, h * g:(h + 1) * g] = torch.logsumexp(s, -1)
            out[n, h * g:(h + 1) * g] = torch.softmax(s, -1) @ vals
    return out, lse
