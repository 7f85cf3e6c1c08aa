"""Merge attention states (partial outputs + natural-log LSEs) into one output, in Triton."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import launch
from ..checks import FLOAT_DTYPES, check_tensor, next_pow2


@triton.jit
def merge_states_kernel(V, S, O, LSE, num_states,
                         stride_vt, stride_vh, stride_vs, stride_vd,
                         stride_st, stride_sh, stride_ss,
                         stride_ot, stride_oh, stride_od, stride_lt, stride_lh,
                         D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    s_idx = tl.arange(0, BLOCK_S)
    d_idx = tl.arange(0, BLOCK_D)
    s_mask = s_idx < num_states
    lse = tl.load(S + t * stride_st + h * stride_sh + s_idx * stride_ss, mask=s_mask,
                  other=float("inf"))
    # +inf marks an empty state (contract: no valid entry -> lse +inf): weight 0.
    lse = tl.where(lse == float("inf"), float("-inf"), lse)
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)
    w_sum = tl.sum(w, 0)
    has = w_sum > 0
    inv = tl.where(has, 1.0 / tl.where(has, w_sum, 1.0), 0.0)
    v_ptr = (V + t * stride_vt + h * stride_vh + s_idx[:, None] * stride_vs
             + d_idx[None, :] * stride_vd)
    v = tl.load(v_ptr, mask=s_mask[:, None] & (d_idx[None, :] < D), other=0.0).to(tl.float32)
    out = tl.sum(v * (w * inv)[:, None], 0)
    tl.store(O + t * stride_ot + h * stride_oh + d_idx * stride_od, out, mask=d_idx < D)
    lse_out = tl.where(has, m_safe + tl.log(tl.where(has, w_sum, 1.0)), float("inf"))
    tl.store(LSE + t * stride_lt + h * stride_lh, lse_out)


def merge_states(v: torch.Tensor, s: torch.Tensor,
                 out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``num_states`` partial attention results per (token, head).

    Args:
        v: ``[num_tokens, num_heads, num_states, head_dim]`` fp16/bf16/fp32, any strides:
            each state's normalised attention output.
        s: ``[num_tokens, num_heads, num_states]`` fp32, natural-log LSE of each state;
            ``+inf`` (or ``-inf``) marks an empty state that contributes nothing.
        out_dtype: dtype of the merged output (default ``v.dtype``).

    Returns:
        ``(out [num_tokens, num_heads, head_dim] out_dtype, lse [num_tokens, num_heads] fp32)``;
        a (token, head) whose states are all empty gets out 0 and lse ``+inf``.
    """
    check_tensor("v", v, 4, FLOAT_DTYPES)
    check_tensor("s", s, 3, (torch.float32,), v.device)
    if tuple(s.shape) != tuple(v.shape[:3]):
        raise ValueError(f"s: expected shape {tuple(v.shape[:3])}, got {tuple(s.shape)}")
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype: expected one of {FLOAT_DTYPES} or None, got {out_dtype}")
    t, h, n, d = v.shape
    out = torch.empty(t, h, d, dtype=out_dtype or v.dtype, device=v.device)
    lse = torch.empty(t, h, dtype=torch.float32, device=v.device)
    if t == 0 or h == 0:
        return out, lse
    if n == 0:
        return out.zero_(), lse.fill_(float("inf"))
    merge_states_kernel[(t, h)](
        v, s, out, lse, n, *v.stride(), *s.stride(), *out.stride(), *lse.stride(),
        D=d, BLOCK_S=max(2, next_pow2(n)), BLOCK_D=next_pow2(d),
        num_warps=launch.MERGE_NUM_WARPS)
    return out, lse
