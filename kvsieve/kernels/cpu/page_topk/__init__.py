"""Page top-k of one decode token over a page-summary pool (Quest's ``bound`` and RocketKV's
``sign`` scoring), on the CPU: the native C kernel beside its plain-PyTorch ``naive`` twin.

Inputs:

* ``pool [num_blocks, Hkv, S, 2, D]`` bf16, fp32 (or fp8, naive only): per block, per KV head,
  ``S`` pages' ``(min, max)`` key summaries (``[..., 0, :]`` = min); page ``p`` of the request
  is sub-page ``p % S`` of block ``block_ids[p // S]``.
* ``block_ids [ceil(n_pages / S)]`` int64: the request's blocks in order.
* ``q [Hq, D]`` (any float dtype; ``Hq = Hkv * G``, query head ``j`` in KV group ``j // G``),
  with any channel filter already applied (zeroed channels).

Per KV head, per page: ``bound`` scores ``sum_d max(q_d min_d, q_d max_d)``
(``min(q,0) . min + max(q,0) . max``), ``sign`` scores ``q . k_hat`` with ``k_hat`` = max on the
channels where the group's summed query is positive and min elsewhere; times ``sm_scale``, a
softmax over the pages per query head, the mean over the group, the newest page
(``n_pages - 1``) set to 2.0 (it always wins), then the top ``k`` pages, ties to the lower page.

:func:`page_topk` returns ``PageTopK(indices [Hkv, k] int32 ascending, scores [Hkv, n_pages]
fp32, engine)``; ``engine`` is ``"native"`` or ``"naive"``. The native kernel reads the pool in
place (no gather, no fp32 copy); its fp32 sums run in another order and its ``exp`` is its own
(~1 ulp), so its scores match the naive ones to the fp32 rounding of the logits and the pages are
the same unless two scores are that close. It runs for CPU tensors, bf16/fp32 pools, ``D <= 256``, ``G <= 16``
when its library builds (:mod:`..build`); otherwise the naive path runs.

:func:`page_topk_rows` does the same for the decode tokens of many requests in one native call
(their block tables as rows of one table) and returns their indices side by side; without the
library it runs :func:`page_topk` per row.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..build import NativeUnavailable
from .naive import page_topk_naive
from .native import MAX_D, MAX_G, SOURCE, page_topk_native, page_topk_rows_native

__all__ = ["PageTopK", "SOURCE", "page_topk", "page_topk_naive", "page_topk_native", "page_topk_rows",
           "page_topk_rows_native", "supports_native"]

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
