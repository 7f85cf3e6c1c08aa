"""Sparse absorbed-MLA decode on the CuTe gather-attention kernel (SM90 wgmma / SM100 tcgen05), bf16
or FP8 (FlashMLA V3.2, 656 bytes/token, :mod:`.fp8`) latent cache: request-local selections
(:func:`sparse_mla_decode`) or FlashMLA-style physical slots (:func:`sparse_mla_decode_slots`).
Reference: :mod:`.naive`."""
from __future__ import annotations

import torch

from ..common.checks import check_tensor, resolve_scale
from ..common.gather.cute.host import BLOCK_N, launch, pad_rows, request_local_to_rows, require_arch

__all__ = ["sparse_mla_decode", "sparse_mla_decode_slots"]


def sparse_mla_decode_slots(q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                            kv_lora_rank: int = 512, sm_scale: float | None = None,
                            num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA-style sparse MLA decode over physical slots.

    Args:
        q: ``[T, H, 576]`` bf16, ``H`` any (64/128 typical; padded to the MMA rows inside).
        cache: ``[num_blocks, page_size, 576]`` bf16 latent pool, or ``[num_blocks, page_size,
            656]`` uint8 FP8 rows (FlashMLA V3.2 format); pages contiguous
            (``stride(0) == page_size * stride(1)``, unit last stride).
        slots: ``[T, topk]`` int32 ``page * page_size + offset``, -1 = skip (any topk).
        kv_lora_rank: 512 (the only value the kernels are built for).
    Returns:
        ``out [T, H, 512]`` bf16 and ``lse [T, H]`` fp32 natural log (empty row: 0 / +inf).
    """
    check_tensor("q", q, 3, (torch.bfloat16,))
    check_tensor("cache", cache, 3, (torch.bfloat16, torch.uint8), q.device)
    check_tensor("slots", slots, 2, (torch.int32,), q.device)
    if kv_lora_rank != 512 or q.shape[2] != 576:
        raise ValueError(f"q: expected [T, H, 576] with kv_lora_rank 512, got {tuple(q.shape)} "
                         f"and {kv_lora_rank}")
    fp8 = cache.dtype == torch.uint8
    width = 656 if fp8 else 576
    if cache.shape[2] != width or cache.stride(2) != 1 or \
            cache.stride(0) != cache.shape[1] * cache.stride(1) or cache.stride(1) % 8:
        raise ValueError(f"cache: expected [num_blocks, page_size, {width}] with contiguous pages "
                         f"and a row stride multiple of 8, got shape {tuple(cache.shape)} "
                         f"strides {cache.stride()}")
    if slots.shape[0] != q.shape[0]:
        raise ValueError(f"slots: expected {q.shape[0]} rows (q's tokens), got {slots.shape[0]}")
    arch = require_arch(q.device)
    rows_view = cache.as_strided((cache.shape[0] * cache.shape[1], width), (cache.stride(1), 1))
    rows = pad_rows(slots, BLOCK_N[arch]).unsqueeze(1)
    return launch("mla_fp8" if fp8 else "mla", q, rows_view, rows_view, rows, kv_lora_rank,
                  resolve_scale(sm_scale, 576), num_splits)


def sparse_mla_decode(q: torch.Tensor, latent_cache: torch.Tensor, block_table: torch.Tensor,
                      token_to_req: torch.Tensor, kv_lens: torch.Tensor, indices: torch.Tensor,
                      offsets: torch.Tensor, kv_lora_rank: int = 512,
                      sm_scale: float | None = None, num_splits: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same arguments/result as ``kvsieve.kernels.sparse_mla_decode.triton.sparse_mla_decode`` (request-local
    ``indices [1, total]`` + ``offsets``), bf16 or FP8 (uint8 ``[.., 656]``) latent cache.
    Token ``t``'s entries are translated to physical slots, entries ``< 0`` or ``>=
    kv_lens[t]`` to -1, and padded to ``[T, max_len]`` (one host sync for ``max_len``)."""
    check_tensor("indices", indices, 2, (torch.int32,), q.device)
    check_tensor("offsets", offsets, 1, (torch.int32,), q.device)
    if indices.shape[0] != 1:
        raise ValueError(f"indices: expected one KV head row for MLA, got {indices.shape[0]}")
    if offsets.shape[0] != q.shape[0] + 1:
        raise ValueError(f"offsets: expected {q.shape[0] + 1} entries, got {offsets.shape[0]}")
    slots = request_local_to_rows(indices, offsets, token_to_req, block_table, kv_lens,
                                  latent_cache.shape[1], 1)[:, 0]
    return sparse_mla_decode_slots(q, latent_cache, slots, kv_lora_rank, sm_scale, num_splits)
