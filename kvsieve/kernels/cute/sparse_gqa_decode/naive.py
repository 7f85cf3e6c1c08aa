"""Plain-PyTorch reference of the CuTe :func:`~kvsieve.kernels.cute.sparse_gqa_decode.sparse_gqa_decode`
(same arguments and result): the shared gather-attention reference over the same selection,
without skip-softmax and in one split (the CuTe kernel merges its splits exactly)."""
from __future__ import annotations

import torch

from ...triton.sparse_gqa_decode.naive import sparse_gqa_decode as gather_reference

__all__ = ["sparse_gqa_decode"]


def sparse_gqa_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_table: torch.Tensor, token_to_req: torch.Tensor,
                      kv_lens: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
                      block_size: int = 1, sm_scale: float | None = None,
                      num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of the CuTe GQA decode; ``num_splits`` is accepted and ignored (one split)."""
    if indices is None:
        raise ValueError("indices: the CuTe GQA kernel is sparse only (dense: use 'triton')")
    return gather_reference(q, k_cache, v_cache, block_table, token_to_req, kv_lens, indices, offsets,
                            block_size, sm_scale, 0.0, None, 1)
