"""Plain-PyTorch references of the GQA decode: :func:`sparse_gqa_decode` (of the Triton kernel and
the CuTe one: same signature, same tile walk as the shared gather,
:mod:`kvsieve.kernels.common.gather.naive`), and :func:`sparse_decode_naive` /
:func:`sparse_decode_runs_naive` (the twins of the native CPU kernels, :mod:`.native`: same
arguments over runs of the cache; gather the runs, mask, softmax)."""
from __future__ import annotations

import numpy as np
import torch

from ..common.gather.naive import gather_attention_reference
from ..common.gather.plan import plan_gqa_gather
from .runs import TokenRuns

__all__ = ["sparse_decode_naive", "sparse_decode_runs_naive", "sparse_gqa_decode"]


def sparse_gqa_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    token_to_req: torch.Tensor, kv_lens: torch.Tensor, indices: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None, block_size: int = 1, sm_scale: float | None = None,
    threshold_scale_factor: float = 0.0, stats: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``sparse_gqa_decode.triton.sparse_gqa_decode``: same arguments and result."""
    plan = plan_gqa_gather(q, k_cache, v_cache, block_table, token_to_req, kv_lens, indices,
                           offsets, block_size, sm_scale, threshold_scale_factor, stats,
                           num_splits)
    return gather_attention_reference(q, k_cache, v_cache, block_table, token_to_req, kv_lens,
                                      indices, offsets, block_size, plan, stats)


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
