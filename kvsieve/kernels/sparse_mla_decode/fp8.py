"""The FlashMLA V3.2 FP8 latent-row format (656 bytes/token) of the CuTe MLA decode, in plain PyTorch.

Token format: 512 ``float8_e4m3fn`` latent values, 4 fp32 scales (one per 128 values, powers of
two as in FlashMLA's quantizer), 64 bf16 rope values. The dequantizing reference of the FP8 kernel
is ``naive.sparse_mla_decode_fp8_reference``.
"""
from __future__ import annotations

import torch

FP8_ROW_BYTES = 656
NOPE, ROPE, GROUP = 512, 64, 128


def quantize_fp8_mla(latent: torch.Tensor) -> torch.Tensor:
    """``[..., 576]`` bf16/fp32 latent rows -> ``[..., 656]`` uint8 FlashMLA FP8 rows."""
    if latent.shape[-1] != NOPE + ROPE:
        raise ValueError(f"latent: expected last dim {NOPE + ROPE}, got {latent.shape[-1]}")
    x = latent.float()
    nope = x[..., :NOPE].reshape(*x.shape[:-1], NOPE // GROUP, GROUP)
    amax = nope.abs().amax(-1).clamp(min=1e-20)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q8 = (nope / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    out = torch.empty(*x.shape[:-1], FP8_ROW_BYTES, dtype=torch.uint8, device=latent.device)
    out[..., :NOPE] = q8.reshape(*x.shape[:-1], NOPE).view(torch.uint8)
    out[..., NOPE:NOPE + 16] = scale.float().contiguous().view(torch.uint8)
    out[..., NOPE + 16:] = x[..., NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return out


def dequantize_fp8_mla(cache: torch.Tensor) -> torch.Tensor:
    """``[..., 656]`` uint8 FlashMLA FP8 rows -> ``[..., 576]`` bf16 (``e4m3 * scale``, rope)."""
    if cache.dtype != torch.uint8 or cache.shape[-1] != FP8_ROW_BYTES:
        raise ValueError(f"cache: expected uint8 [..., {FP8_ROW_BYTES}], got {cache.dtype} "
                         f"{tuple(cache.shape)}")
    lead = cache.shape[:-1]
    c = cache.contiguous()
    q8 = c[..., :NOPE].view(torch.float8_e4m3fn).float().reshape(*lead, NOPE // GROUP, GROUP)
    scale = c[..., NOPE:NOPE + 16].view(torch.float32).reshape(*lead, NOPE // GROUP)
    rope = c[..., NOPE + 16:].view(torch.bfloat16).float()
    nope = (q8 * scale[..., None]).reshape(*lead, NOPE)
    return torch.cat([nope, rope], -1).to(torch.bfloat16)
