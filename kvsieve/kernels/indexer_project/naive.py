"""The plain-PyTorch twin of ``indexer_project.c`` (the contract: :mod:`kvsieve.kernels.indexer_project`)."""
from __future__ import annotations

import torch

__all__ = ["indexer_project_naive"]


def _neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """``x [T, ..., D]`` with its first ``rope_dim`` channels rotated by halves (``cos/sin [T, rope_dim]``)."""
    half = rope_dim // 2
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos[:, :half].reshape(shape), sin[:, :half].reshape(shape)
    x1, x2 = x[..., :half], x[..., half:rope_dim]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., rope_dim:]], dim=-1)


def indexer_project_naive(hidden: torch.Tensor, stacked: torch.Tensor, norm_weight: torch.Tensor | None,
                          norm_bias: torch.Tensor | None, eps: float, cos: torch.Tensor | None,
                          sin: torch.Tensor | None, n_heads: int, head_dim: int, rope_dim: int, w_scale: float
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [T, H, D], k [T, D], w [T, H])`` fp32 (the package docstring)."""
    h, d = n_heads, head_dim
    q, w, k = (hidden.float() @ stacked.T).split((h * d, h, d), dim=-1)
    if norm_weight is not None:
        k = torch.nn.functional.layer_norm(k, (d,), norm_weight, norm_bias, eps)
    q = q.reshape(-1, h, d)
    if rope_dim:
        q, k = _neox(q, cos, sin, rope_dim), _neox(k, cos, sin, rope_dim)
    return q, k, w * w_scale
