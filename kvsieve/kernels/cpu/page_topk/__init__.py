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
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..build import NativeUnavailable
from .naive import page_topk_naive
from .native import MAX_D, MAX_G, SOURCE, page_topk_native

__all__ = ["PageTopK", "SOURCE", "page_topk", "page_topk_naive", "page_topk_native", "supports_native"]

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
