"""The plain-PyTorch twin of :func:`~kvsieve.kernels.page_minmax.plan.page_minmax` (any device)."""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["OUT_OF_RANGE", "page_minmax_naive"]

OUT_OF_RANGE = ("page_minmax: a page lies outside its block or the cache, does not start on a page boundary, "
                "or holds no key")


def page_minmax_naive(keys: torch.Tensor, blocks: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                      pool: torch.Tensor) -> None:
    """As :func:`~kvsieve.kernels.page_minmax.plan.page_minmax`: one gather of every page's
    ``page_size`` key slots ``[n, page_size, Hkv, D]``, the slots past a page's count masked, then
    min/max in fp32, written to the pool in its dtype."""
    if not blocks.size:
        return
    ps = keys.shape[2] // pool.shape[2]
    if bool(((blocks < 0) | (blocks >= keys.shape[0]) | (starts < 0) | (starts % ps != 0) | (counts < 1)
             | (counts > ps) | (starts + counts > keys.shape[2])).any()):
        raise ValueError(OUT_OF_RANGE)
    dev = keys.device
    pos = torch.from_numpy(starts.astype(np.int64)).unsqueeze(1) + torch.arange(ps)  # [n, ps] token in block
    valid = (torch.arange(ps) < torch.from_numpy(counts.astype(np.int64)).unsqueeze(1)).to(dev)
    blk = torch.from_numpy(blocks.astype(np.int64)).to(dev)
    k = keys[blk.unsqueeze(1), :, pos.clamp(max=keys.shape[2] - 1).to(dev)].float()  # [n, ps, Hkv, D]
    mask = valid[:, :, None, None]
    kmin = k.masked_fill(~mask, float("inf")).amin(dim=1)
    kmax = k.masked_fill(~mask, float("-inf")).amax(dim=1)
    sub = torch.from_numpy(starts.astype(np.int64) // ps).to(dev)
    pool[blk, :, sub] = torch.stack([kmin, kmax], dim=2).to(pool.dtype)  # [n, Hkv, 2, D]
