"""The entry point of :mod:`kvsieve.kernels.page_topk` (the contract is there): the native kernel
where it takes the inputs and its library is available, else the plain twin."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..common.native import NativeUnavailable
from .naive import page_topk_naive
from .native import MAX_D, MAX_G, page_topk_native, page_topk_rows_native

__all__ = ["PageTopK", "page_topk", "page_topk_rows", "supports_native"]

MODES = ("bound", "sign")


class PageTopK(NamedTuple):
    indices: torch.Tensor  # [Hkv, k] int32, ascending page ids
    scores: torch.Tensor  # [Hkv, n_pages] fp32, the newest page at 2.0
    engine: str  # "native" | "naive"


def supports_native(pool: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether the native kernel takes these inputs (its library may still be unavailable)."""
    hkv, d = pool.shape[1], pool.shape[4]
    return (pool.device.type == "cpu" and q.device.type == "cpu" and pool.is_contiguous()
            and pool.dtype in (torch.bfloat16, torch.float32) and d <= MAX_D and q.shape[0] // hkv <= MAX_G)


def page_topk(pool: torch.Tensor, block_ids: torch.Tensor, n_pages: int, q: torch.Tensor, *, sm_scale: float,
              mode: str, k: int) -> PageTopK:
    """The top ``k`` pages per KV head of one decode token (module docstring)."""
    hkv, sub = pool.shape[1], pool.shape[2]
    if mode not in MODES:
        raise ValueError(f"page_topk: mode must be one of {MODES}, got {mode!r}")
    if not 1 <= k <= n_pages:
        raise ValueError(f"page_topk: k must be in [1, n_pages={n_pages}], got {k}")
    if q.dim() != 2 or q.shape[1] != pool.shape[4] or q.shape[0] % hkv:
        raise ValueError(f"page_topk: q must be [Hkv * G, D] = [{hkv} * G, {pool.shape[4]}], got {tuple(q.shape)}")
    if block_ids.numel() * sub < n_pages:
        raise ValueError(f"page_topk: {block_ids.numel()} blocks of {sub} pages cannot hold {n_pages} pages")
    if supports_native(pool, q):
        try:
            sel, scores = page_topk_native(pool, block_ids, n_pages, q, sm_scale=sm_scale, mode=mode, k=k)
            return PageTopK(sel, scores, "native")
        except NativeUnavailable:
            pass
    sel, scores = page_topk_naive(pool, block_ids, n_pages, q, sm_scale=sm_scale, mode=mode, k=k)
    return PageTopK(sel, scores, "naive")


def page_topk_rows(pool: torch.Tensor, table: np.ndarray, n_pages: np.ndarray, q: torch.Tensor, *, sm_scale: float,
                   mode: str, ks: np.ndarray) -> torch.Tensor:
    """:func:`page_topk` of ``N`` decode tokens: ``q [N, Hq, D]``, token ``n``'s blocks in
    ``table[n]`` (``[N, W]`` block ids), its ``n_pages[n]`` pages, ``ks[n]`` kept per head ->
    ``indices [Hkv, sum(ks)]`` int32, token ``n``'s (ascending) after those of the tokens before it.
    One native call for two tokens or more (same pages as :func:`page_topk` per token), else
    :func:`page_topk` per token (one token: its own call has less set-up; or where the native kernel
    does not take the inputs)."""
    n_pages, ks = np.ascontiguousarray(n_pages, dtype=np.int64), np.ascontiguousarray(ks, dtype=np.int64)
    if q.dim() != 3 or not q.shape[0] == table.shape[0] == n_pages.size == ks.size:
        raise ValueError(f"page_topk_rows: q [N, Hq, D], table [N, W], n_pages and ks [N] must agree, got "
                         f"{tuple(q.shape)}, {table.shape}, {n_pages.size}, {ks.size}")
    if not q.shape[0]:
        return torch.empty(pool.shape[1], 0, dtype=torch.int32)
    if q.shape[0] > 1 and mode in MODES and supports_native(pool, q[0]) and q.shape[2] == pool.shape[4] and q.shape[1] % pool.shape[1] == 0:
        try:  # None: a k or page count the kernel refuses; page_topk below names it
            sel = page_topk_rows_native(pool, np.ascontiguousarray(table, dtype=np.int64), n_pages, q,
                                        sm_scale=sm_scale, mode=mode, ks=ks)
        except NativeUnavailable:
            sel = None
        if sel is not None:
            return sel
    sels = [page_topk(pool, torch.from_numpy(table[n].astype(np.int64)), int(n_pages[n]), q[n], sm_scale=sm_scale,
                      mode=mode, k=int(ks[n])).indices for n in range(q.shape[0])]
    return sels[0] if len(sels) == 1 else torch.cat(sels, dim=1)
