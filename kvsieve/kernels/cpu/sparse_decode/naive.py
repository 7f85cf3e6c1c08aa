"""Plain-PyTorch reference of :func:`~kvsieve.kernels.cpu.sparse_decode.sparse_decode_native`
(the contract is in the package docstring): gather the runs, mask, softmax."""
from __future__ import annotations

import torch

__all__ = ["sparse_decode_naive"]


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
