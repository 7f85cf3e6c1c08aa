"""Plain-PyTorch reference of :func:`~kvsieve.kernels.page_topk.plan.page_topk` (the contract is
there): gather the pages' rows, one batched GEMV, softmax, mean, a stable sort."""
from __future__ import annotations

import torch

__all__ = ["page_topk_naive"]


def page_topk_naive(pool: torch.Tensor, block_ids: torch.Tensor, n_pages: int, q: torch.Tensor, *,
                    sm_scale: float, mode: str, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices [Hkv, k] int32 ascending, scores [Hkv, n_pages] fp32)``."""
    hkv, d = pool.shape[1], pool.shape[4]
    rows = pool.index_select(0, block_ids.to(pool.device)).float()  # [n_blk, Hkv, S, 2, D]
    summ = rows.permute(1, 0, 2, 3, 4).reshape(hkv, -1, 2 * d)[:, :n_pages]  # [Hkv, Np, 2D]
    qg = q.float().view(hkv, -1, d)  # [Hkv, G, D]
    if mode == "sign":
        use_max = (qg.sum(dim=1, keepdim=True) > 0).expand_as(qg)
        zero = torch.zeros_like(qg)
        qcat = torch.cat([torch.where(use_max, zero, qg), torch.where(use_max, qg, zero)], dim=-1)
    else:
        qcat = torch.cat([qg.clamp(max=0), qg.clamp(min=0)], dim=-1)  # [Hkv, G, 2D]
    logits = torch.matmul(qcat, summ.transpose(-1, -2)) * sm_scale  # [Hkv, G, Np]
    scores = torch.softmax(logits, dim=-1).mean(dim=1)
    scores[:, n_pages - 1] = 2.0  # the newest page (scores are <= 1)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]  # ties: lower page first
    return order.sort(dim=-1).values.to(torch.int32), scores
