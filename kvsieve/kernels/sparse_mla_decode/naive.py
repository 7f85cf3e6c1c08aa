"""Plain-PyTorch references of the MLA decode: :func:`sparse_mla_decode` (of the Triton kernel and
the CuTe bf16 one: same signature, same tile walk) and :func:`sparse_mla_decode_fp8_reference`
(of the CuTe FP8 kernel)."""
from __future__ import annotations

import torch

from ..common.gather.naive import gather_attention_reference
from .fp8 import NOPE, dequantize_fp8_mla
from .plan import latent_views, plan_mla_decode

__all__ = ["sparse_mla_decode", "sparse_mla_decode_fp8_reference"]


def sparse_mla_decode(
    q: torch.Tensor, latent_cache: torch.Tensor, block_table: torch.Tensor,
    token_to_req: torch.Tensor, kv_lens: torch.Tensor, indices: torch.Tensor | None,
    offsets: torch.Tensor | None, kv_lora_rank: int, sm_scale: float | None = None,
    threshold_scale_factor: float = 0.0, stats: torch.Tensor | None = None,
    num_splits: int | None = None, *, block_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``sparse_mla_decode.triton.sparse_mla_decode``: same arguments and result."""
    plan = plan_mla_decode(q, latent_cache, block_table, token_to_req, kv_lens, indices,
                           offsets, kv_lora_rank, sm_scale, threshold_scale_factor, stats,
                           num_splits, block_size)
    k4, v4 = latent_views(latent_cache, kv_lora_rank)
    return gather_attention_reference(q, k4, v4, block_table, token_to_req, kv_lens, indices,
                                      offsets, block_size, plan, stats)


def sparse_mla_decode_fp8_reference(q: torch.Tensor, cache_fp8: torch.Tensor,
                                    block_table: torch.Tensor, token_to_req: torch.Tensor,
                                    kv_lens: torch.Tensor, indices: torch.Tensor | None,
                                    offsets: torch.Tensor | None, sm_scale: float | None = None,
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of the FP8 kernel: dequantize the ``[num_blocks, page, 656]`` cache to bf16,
    then the bf16 reference (``kv_lora_rank`` 512). Returns ``(out, lse)`` like the kernel."""
    latent = dequantize_fp8_mla(cache_fp8).to(q.dtype)
    return sparse_mla_decode(q, latent, block_table, token_to_req, kv_lens, indices, offsets, NOPE, sm_scale)
