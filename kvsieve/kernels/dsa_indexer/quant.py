"""FP8 E4M3 quantization with power-of-two (UE8M0-style) scales, for index keys and queries."""
from __future__ import annotations

import torch

__all__ = ["quantize_pow2_fp8", "FP8_MAX"]

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_pow2_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last dim of ``x [..., D]`` to ``float8_e4m3fn`` with one scale per row.

    The scale is the smallest power of two ``s`` with ``amax / s <= 448`` (so dequantizing is an
    exponent shift); an all-zero row gets ``s = 1``. Returns ``(x_fp8 [..., D], scale [...] fp32)``
    with ``x ~= x_fp8.float() * scale``.
    """
    amax = x.float().abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    scale = torch.where(x.float().abs().amax(dim=-1) > 0, scale, torch.ones_like(scale))
    return (x.float() / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale
