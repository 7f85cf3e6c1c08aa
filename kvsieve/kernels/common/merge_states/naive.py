"""Plain-PyTorch reference of :func:`merge_states` (same signature)."""
from __future__ import annotations

import torch

from ..checks import FLOAT_DTYPES, check_tensor


def merge_states(v: torch.Tensor, s: torch.Tensor,
                 out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference merge; shapes and semantics as in ``merge_states.triton.merge_states``."""
    check_tensor("v", v, 4, FLOAT_DTYPES)
    check_tensor("s", s, 3, (torch.float32,), v.device)
    if tuple(s.shape) != tuple(v.shape[:3]):
        raise ValueError(f"s: expected shape {tuple(v.shape[:3])}, got {tuple(s.shape)}")
    lse = torch.where(torch.isinf(s), torch.full_like(s, float("-inf")), s)
    m = lse.amax(dim=-1, keepdim=True) if s.shape[-1] else s.new_full((*s.shape[:2], 1), -1e30)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m)
    w_sum = w.sum(-1)
    out = (v.float() * w.unsqueeze(-1)).sum(2) / torch.where(w_sum > 0, w_sum, 1.0).unsqueeze(-1)
    out_lse = torch.where(w_sum > 0, m.squeeze(-1) + torch.log(w_sum),
                          torch.full_like(w_sum, float("inf")))
    return out.to(out_dtype or v.dtype), out_lse
