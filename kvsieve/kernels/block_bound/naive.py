"""The plain-PyTorch reference of :func:`.native.block_bound_topk_native` (same arguments and result),
one row and KV head at a time: Quest's bound ``sum_d max(q_d * min_d, q_d * max_d)`` of each visible
block per query head, the group's largest times ``sm_scale``, the forced blocks ``+inf``, a stable
descending sort (ties to the lower block), the first ``k`` blocks ascending."""
from __future__ import annotations

import torch

__all__ = ["block_bound_topk_naive"]


def block_bound_topk_naive(bounds: torch.Tensor, own: torch.Tensor, q: torch.Tensor, req: torch.Tensor,
                           lens: torch.Tensor, *, block_size: int, k: int, init_units: int, local_units: int,
                           sm_scale: float) -> torch.Tensor:
    """int32 ``[n, Hkv, k]``: per row and KV head the ``k`` best blocks ascending, ``-1`` after."""
    n, hkv, d2 = own.shape
    d = d2 // 2
    g = q.shape[1] // hkv
    out = torch.full((n, hkv, k), -1, dtype=torch.int32)
    for r in range(n):
        n_valid = -(-int(lens[r]) // block_size)
        for h in range(hkv):
            qg = q[r, h * g: (h + 1) * g].float()  # [G, D]
            summ = torch.cat([bounds[int(req[r]), : n_valid - 1, h], own[r, h][None]])  # [n_valid, 2D]
            per_head = torch.maximum(qg[:, None] * summ[None, :, :d], qg[:, None] * summ[None, :, d:]).sum(-1)
            score = per_head.amax(0) * sm_scale
            j = torch.arange(n_valid)
            score = score.masked_fill((j < init_units) | (j >= n_valid - local_units), float("inf"))
            best = torch.sort(score, descending=True, stable=True).indices[:k]
            out[r, h, : best.numel()] = best.sort().values.to(torch.int32)
    return out
