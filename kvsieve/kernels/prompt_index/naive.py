"""The plain-PyTorch reference of :func:`.native.prompt_index_topk_native` (same arguments and
result): the indexer's reference logits over the paged pool
(:func:`kvsieve.kernels.dsa_indexer.naive.indexer_logits_decode`) and the ``torch`` top-k engine
(:func:`kvsieve.kernels.topk.naive.torch_topk`), each row's positions sorted ascending."""
from __future__ import annotations

import numpy as np
import torch

from ...sparse import SparseRuntimeParams
from ..dsa_indexer.naive import indexer_logits_decode
from ..topk.naive import torch_topk

__all__ = ["prompt_index_topk_naive"]


def prompt_index_topk_naive(pool: torch.Tensor, table: np.ndarray, slots: np.ndarray, lens: np.ndarray,
                            q: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    """int32 ``[n, k]``: per row the ``k`` best positions ascending, ``-1`` after."""
    lens_t = torch.from_numpy(np.asarray(lens, dtype=np.int32))
    width = max(int(lens_t.max()), 1) if lens_t.numel() else 1
    logits = indexer_logits_decode(q.float(), pool, None, w.float(), torch.from_numpy(np.asarray(table, np.int32)),
                                   torch.from_numpy(np.asarray(slots, dtype=np.int32)), lens_t, width)
    return SparseRuntimeParams.sort_padding_last(torch_topk(logits, lens_t, k)).to(torch.int32)
