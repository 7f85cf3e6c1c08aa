"""The plain-PyTorch reference of :func:`.native.causal_rows_native`: the same arguments and result,
computed per request as a dense softmax over its gathered positions with a causal mask."""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["causal_rows_naive"]


def causal_rows_naive(k: torch.Tensor, v: torch.Tensor, block_table: np.ndarray, qo_indptr: np.ndarray,
                      kv_lens: np.ndarray, q: torch.Tensor, *, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [N, Hq, D] fp32, lse [N, Hq] fp32)``: request ``r``'s positions ``[0, kv_lens[r])``
    gathered from its blocks, each of its ``R`` rows' scores ``-inf`` past its own position, a softmax
    in fp32."""
    n, hq, d = q.shape
    hkv, bs = k.shape[1], k.shape[2]
    g = hq // hkv
    out = torch.empty(n, hq, d, dtype=torch.float32)
    lse = torch.empty(n, hq, dtype=torch.float32)
    for r in range(len(kv_lens)):
        a, b, length = int(qo_indptr[r]), int(qo_indptr[r + 1]), int(kv_lens[r])
        pos = torch.arange(length)
        blocks = torch.as_tensor(block_table[r], dtype=torch.int64)[pos // bs]
        keys = k[blocks, :, pos % bs].float()  # [L, Hkv, D]
        vals = v[blocks, :, pos % bs].float()
        sees = pos[None, :] < (length - (b - a) + torch.arange(b - a) + 1)[:, None]  # [R, L]
        qr = q[a:b].float().view(b - a, hkv, g, d)
        s = torch.einsum("rhgd,lhd->rhgl", qr, keys) * sm_scale
        s = s.masked_fill(~sees[:, None, None], -torch.inf)
        lse[a:b] = torch.logsumexp(s, -1).reshape(b - a, hq)
        out[a:b] = torch.einsum("rhgl,lhd->rhgd", torch.softmax(s, -1), vals).reshape(b - a, hq, d)
    return out, lse
