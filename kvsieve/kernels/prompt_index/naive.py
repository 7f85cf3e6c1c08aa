"""The plain-PyTorch reference of :func:`.native.prompt_index_topk_native` (same arguments and
result), one row at a time: the row's keys gathered through its block table, the indexer's score of
each in fp32 (``einsum``), a stable descending sort (ties to the lower position), the first ``k``
positions ascending."""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["prompt_index_topk_naive"]


def prompt_index_topk_naive(pool: torch.Tensor, table: np.ndarray, slots: np.ndarray, lens: np.ndarray,
                            q: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    """int32 ``[n, k]``: per row the ``k`` best positions ascending, ``-1`` after."""
    bs = pool.shape[1]
    out = torch.full((len(lens), k), -1, dtype=torch.int32)
    for n, (slot, length) in enumerate(zip(slots.tolist(), lens.tolist())):
        pos = torch.arange(length)
        blocks = torch.from_numpy(np.asarray(table[slot], dtype=np.int64))[pos // bs]
        keys = pool[blocks, pos % bs].float()  # [len, id]
        score = torch.einsum("h,hl->l", w[n].float(), torch.einsum("hd,ld->hl", q[n].float(), keys).relu())
        best = torch.sort(score, descending=True, stable=True).indices[:k]
        out[n, : best.numel()] = best.sort().values.to(torch.int32)
    return out
