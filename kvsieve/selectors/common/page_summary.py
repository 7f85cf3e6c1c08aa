"""Stage 2 of RocketKV, shared by ``rocketkv`` and ``quest``: page summaries and page top-k.

*Summaries.* Per page of ``page_size`` tokens and per KV head, the element-wise min and max of K,
kept in an auxiliary pool of the KV cache manager that shares the main cache's block ids:
``[num_blocks, Hkv, tokens_per_block // page_size, 2, D]`` (index 0 = min, 1 = max) in the summary
dtype (bf16, fp8 e5m2 or fp32; values are rounded to nearest). One page's ``(min, max)`` of one head
is a contiguous row of ``2 * D``, so a request's pages are read head-major ``[Hkv, pages, 2 * D]``
(one block gather, or a slice of the pool when its blocks are contiguous and ascending) and
scored by one batched GEMV per (query token, KV head); a step whose generation rows are one token
per request (decode) hands the pool and each request's block ids to
:func:`kvsieve.kernels.page_topk.plan.page_topk`, which reads the rows in place. A page is recomputed from the
cache (:func:`kvsieve.kernels.page_minmax.plan.page_minmax`, in place) whenever a token is written into it, and
every page of a request after compaction.
A query token reads its own page's summary over the positions up to itself only (recomputed from
the cache), so with several query tokens of one request in a step an earlier token's choice never
depends on a later token's key: ``k`` tokens in one step select what ``k`` one-token steps do.

*Scoring* of page ``p`` for query head ``j`` (``sm_scale`` applied, fp32):

* ``sign`` (RocketKV): per channel take ``max_d`` where the KV group's summed query channel is
  positive and ``min_d`` otherwise, then ``q_j . k_hat``; an optional top-``topr`` channel
  filter (largest ``|q|`` summed over the group) zeroes the other channels first.
* ``bound`` (Quest): ``sum_d max(q_d * min_d, q_d * max_d)``, an upper bound of ``q . k`` over the page.

Then softmax over the query's valid pages, mean over the group's query heads, the newest page is
forced in, and the top ``min(topk, pages)`` pages per (query token, KV head) are kept (ties to
the lower page). Indices are page ids (block granularity ``page_size``). On a sliding-window layer
the pages lying wholly before a query's window are not candidates (they get no softmax share and
are never picked; :meth:`~kvsieve.sparse.SelectorInputs.mask_outside_window`). With ``top_p`` the
list (newest page first, then by score) is cut where the scores before the next page reach
``top_p`` (:func:`.paged.top_p_cut`; the scores are each query's page distribution, summing to 1).
"""
from __future__ import annotations

from itertools import accumulate

import numpy as np
import torch

from ...kernels.page_minmax.plan import page_minmax
from ...kernels.page_topk.plan import page_topk_rows
from ...metadata import KVCacheManager
from ...sparse import SelectorInputs, SparseRuntimeParams
from .paged import drop_empty_columns, pack_generation_rows, top_p_count, top_p_cut, top_units, top_units_topk

__all__ = ["SUMMARY_DTYPES", "SCORE_MODES", "PageSummaries", "bound_query", "page_scores", "select_pages", "select_pages_naive"]

SUMMARY_DTYPES = {"bfloat16": torch.bfloat16, "float8_e5m2": torch.float8_e5m2, "float32": torch.float32}
SCORE_MODES = ("sign", "bound")


class PageSummaries:
    """The per-layer min/max pools of one KV cache for one (page size, dtype)."""

    def __init__(self, cache: KVCacheManager, page_size: int, dtype: torch.dtype) -> None:
        tpb = cache.tokens_per_block
        if cache.spec.kind != "gqa":
            raise ValueError("page summaries need a GQA cache (kind='gqa')")
        if tpb % page_size:
            raise ValueError(f"page_size={page_size} must divide the KV cache's tokens_per_block={tpb}")
        self.cache, self.page_size, self.dtype = cache, page_size, dtype
        shape = (cache.spec.num_kv_heads, tpb // page_size, 2, cache.spec.head_dim)
        name = f"page_summary_p{page_size}_{str(dtype).removeprefix('torch.')}"
        self.pools = cache.add_aux_pool(name, shape, dtype)

    def refresh(self, layer_idx: int, slots: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> None:
        """Recompute, from the cache, the pages holding positions ``[starts[b], lens[b])`` of the
        requests in ``slots`` (int arrays ``[B]``); ``lens`` are the valid lengths to summarize.
        Every page lies inside one cache block, so the pages are a list of (block, first token,
        keys) for :func:`~kvsieve.kernels.page_minmax.plan.page_minmax`, which reads them in place."""
        ps, tpb = self.page_size, self.cache.tokens_per_block
        keys, pool = self.cache.k_cache(layer_idx), self.pools[layer_idx]
        if len(slots) == 1:  # one request (a decode step: one page), in Python integers
            s, n = int(starts[0]), int(lens[0])
            pos = np.arange(s // ps * ps, n, ps, dtype=np.int64)  # the pages' first positions
            blocks = self.cache.block_table[int(slots[0]), pos // tpb].astype(np.int64)
            page_minmax(keys, blocks, pos % tpb, np.minimum(n - pos, ps), pool)
            return
        first = starts.astype(np.int64) // ps
        count = np.maximum(-(-lens.astype(np.int64) // ps) - first, 0)
        total = int(count.sum())
        if total == 0:
            return
        req = np.repeat(np.arange(len(slots)), count)
        pos = (np.repeat(first, count) + np.arange(total) - np.repeat(np.cumsum(count) - count, count)) * ps
        blocks = self.cache.block_table[slots[req], pos // tpb].astype(np.int64)
        page_minmax(keys, blocks, pos % tpb, np.minimum(lens.astype(np.int64)[req] - pos, ps), pool)

    def prefix(self, layer_idx: int, slots: np.ndarray, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(kmin, kmax)`` each ``[n, Hkv, D]``: for row ``i``, the summary (rounded to the
        summary dtype, as stored) of the page holding ``positions[i]`` over the positions up to and
        including it, of the request in ``slots[i]``.

        Each distinct (request, page) among the rows is read once, ``[P, page_size, Hkv, D]``. Rows
        that share pages (a prompt's) take a running min and max over each page's positions, at their
        own offsets: ``1/page_size`` of the reading of a page a row. Rows each on a page of their own
        (decode rows) mask the positions past their offset and reduce: a few operations where the
        running form takes ``2 * (page_size - 1)``. Positions past a row, written or not, never reach it."""
        ps, tpb, dev = self.page_size, self.cache.tokens_per_block, self.cache.spec.device
        pos, span = positions.astype(np.int64), self.cache.block_table.shape[1] * tpb  # span: a request's positions
        first, inverse = np.unique(slots.astype(np.int64) * span + pos // ps * ps, return_inverse=True)
        page_pos = torch.from_numpy(first % span).unsqueeze(1) + torch.arange(ps)  # [P, ps] each page once
        table = torch.from_numpy(self.cache.block_table[first // span].astype(np.int64))  # [P, max_blocks]
        blk = torch.gather(table, 1, page_pos // tpb).to(dev)
        keys = self.cache.k_cache(layer_idx)[blk, :, (page_pos % tpb).to(dev)].float()  # [P, ps, Hkv, D]
        row_page = torch.from_numpy(inverse.reshape(-1)).to(dev)
        offset = torch.from_numpy(pos % ps).to(dev)
        if len(first) == len(pos):  # a page a row
            past = (torch.arange(ps, device=dev) > offset[:, None])[..., None, None]  # [n, ps, 1, 1]
            rows = keys[row_page]
            kmin = rows.masked_fill(past, float("inf")).amin(dim=1)
            kmax = rows.masked_fill(past, float("-inf")).amax(dim=1)
        else:
            kmin, kmax = keys.clone(), keys  # running min/max over each page's positions, in place
            for j in range(1, ps):  # (torch's cummin/cummax along a middle dim are ~10x slower)
                torch.minimum(kmin[:, j - 1], kmin[:, j], out=kmin[:, j])
                torch.maximum(kmax[:, j - 1], kmax[:, j], out=kmax[:, j])
            kmin, kmax = kmin[row_page, offset], kmax[row_page, offset]
        return kmin.to(self.dtype).float(), kmax.to(self.dtype).float()

    def gather(self, layer_idx: int, slots: np.ndarray, lens: np.ndarray) -> torch.Tensor:
        """fp32 ``[B, Hkv, Np, 2, D]`` (``[..., 0, :]`` = min, ``1`` = max): the first
        ``ceil(lens/page)`` pages of each request (``Np`` = the longest, at least 1); pages past a
        request's length hold arbitrary values. Reads only those pages' blocks: a slice of the
        pool when one request's blocks are contiguous and ascending, one block gather otherwise;
        the upcast to fp32 is of the pages read. Head-major is a strided view (``[..., Np, 2, D]``
        rows ``Hkv * 2 * D`` apart when a block holds one page); with fp32 summaries and a slice it
        is a view of the pool itself: read it, do not write it."""
        ps, tpb = self.page_size, self.cache.tokens_per_block
        pool = self.pools[layer_idx]  # [num_blocks, Hkv, S, 2, D]
        n_pages = max(int(-(-int(lens.max()) // ps)), 1)
        n_blk = -(-n_pages * ps // tpb)
        ids = self.cache.block_table[slots, :n_blk].astype(np.int64)  # [B, n_blk]
        if len(slots) == 1 and (n_blk == 1 or bool((np.diff(ids[0]) == 1).all())):
            blocks = pool[int(ids[0, 0]): int(ids[0, 0]) + n_blk].unsqueeze(0)
        else:
            blocks = pool.index_select(0, torch.from_numpy(ids.reshape(-1)).to(pool.device))
            blocks = blocks.view(len(slots), n_blk, *pool.shape[1:])
        b, _, hkv, sub, _, d = blocks.shape
        # upcast in the pool's order (a contiguous copy runs ~3x faster than one that also
        # transposes), then head-major as a view: a copy only when blocks hold several pages
        out = blocks.float().permute(0, 2, 1, 3, 4, 5)  # [B, Hkv, n_blk, S, 2, D]
        return out.reshape(b, hkv, n_blk * sub, 2, d)[:, :, :n_pages]

    def read(self, layer_idx: int, slots: np.ndarray, lens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(kmin, kmax)`` each ``[B, Np, Hkv, D]`` (views of :meth:`gather`)."""
        summ = self.gather(layer_idx, slots, lens).transpose(1, 2)  # [B, Np, Hkv, 2, D]
        return summ[..., 0, :], summ[..., 1, :]


def keep_top_channels(qg: torch.Tensor, topr: int) -> torch.Tensor:
    """``qg [..., Hkv, G, D]`` with all but the ``topr`` channels of largest ``|q|`` summed over each
    KV group zeroed (``qg`` itself when ``topr >= D``)."""
    d = qg.shape[-1]
    if topr >= d:
        return qg
    channels = qg.abs().sum(dim=-2).topk(topr, dim=-1).indices  # [..., Hkv, topr]
    keep = torch.zeros(*qg.shape[:-2], d, dtype=torch.bool, device=qg.device).scatter_(-1, channels, True)
    return qg * keep.unsqueeze(-2)


def bound_query(q: torch.Tensor) -> torch.Tensor:
    """``[..., 2 * D]``: ``[min(q, 0), max(q, 0)]`` of ``q [..., D]``, whose product with a ``(min, max)``
    summary row is Quest's bound ``sum_d max(q_d * min_d, q_d * max_d)``."""
    return torch.cat([q.clamp(max=0), q.clamp(min=0)], dim=-1)


def page_scores(q: torch.Tensor, summ: torch.Tensor, valid: torch.Tensor | None, *, mode: str, topr: int,
                sm_scale: float) -> torch.Tensor:
    """fp32 ``[T, Hkv, Np]``: softmax-over-pages page scores, averaged over each KV group.

    ``q [T, Hq, D]``; ``summ [T, Hkv, Np, 2, D]`` fp32 (min, max: the summaries of each token's
    request); ``valid [T, Np]`` bool: each token's candidate pages (others score ``-inf``), or
    ``None`` when every page is one.

    Both modes are one GEMV of a ``2 * D`` query against each page's ``(min, max)`` row: ``bound``
    pairs ``min(q, 0)`` with min and ``max(q, 0)`` with max (``max(q_d min_d, q_d max_d)`` term by
    term); ``sign`` pairs ``q`` with max on the group's positive channels and with min elsewhere.
    """
    t, hq, d = q.shape
    hkv, n_pages = summ.shape[1], summ.shape[2]
    qg = keep_top_channels(q.float().view(t, hkv, hq // hkv, d), topr)
    if mode == "sign":
        positive = (qg.sum(dim=2) > 0).unsqueeze(2)  # [T, Hkv, 1, D]
        zero = torch.zeros_like(qg)
        qcat = torch.cat([torch.where(positive, zero, qg), torch.where(positive, qg, zero)], dim=-1)
    else:
        qcat = bound_query(qg)  # [T, Hkv, G, 2D]
    logits = torch.matmul(qcat, summ.view(t, hkv, n_pages, 2 * d).transpose(-1, -2))  # [T, Hkv, G, Np]
    if valid is None:
        return torch.softmax(logits * sm_scale, dim=-1).mean(dim=2)
    logits = (logits * sm_scale).masked_fill(~valid[:, None, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1).mean(dim=2).masked_fill(~valid[:, None, :], float("-inf"))


def _finish(scores: torch.Tensor, n_pages: torch.Tensor, topk: int, top_p: float | None) -> torch.Tensor:
    """Force the newest page (scores are <= 1, so 2 wins) and take the top pages: ``[T, Hkv, k]``
    (``scores [T, Hkv, Np]``, ``-inf`` on invalid pages); with ``top_p`` cut at that mass."""
    newest = (n_pages - 1).clamp(min=0)[:, None, None].expand(-1, scores.shape[1], 1)
    sel = top_units_topk(scores.scatter(-1, newest, 2.0), min(topk, scores.shape[-1]))
    if top_p is None:
        return sel
    mass = torch.gather(scores, -1, sel.clamp(min=0))
    return drop_empty_columns(top_p_cut(sel, mass, torch.ones_like(mass[..., 0]), top_p))


def select_pages(inputs: SelectorInputs, summaries: PageSummaries, *, mode: str, topk: int, topr: int,
                 top_p: float | None) -> SparseRuntimeParams | None:
    """Fast path: batched over every generation token; context rows (mixed batch) stay dense."""
    md = inputs.metadata
    if "generation" not in inputs.phases:
        return None
    ps, c = summaries.page_size, md.num_contexts
    g0 = int(md.query_start_host[c])
    if md.num_tokens - g0 == md.num_seqs - c and inputs.window is None and top_p is None:
        return _select_pages_per_row(inputs, summaries, mode=mode, topk=topk, topr=topr)
    token_lens = md.token_kv_lens.to(torch.int64)
    n_pages = -(-token_lens // ps)  # [T]
    req_host = md.token_to_req_host[g0: md.num_tokens].astype(np.int64) - c
    req = torch.from_numpy(req_host).to(inputs.q.device)
    summ = summaries.gather(inputs.layer_idx, md.slots[c:], md.kv_lens_host[c: md.num_seqs])  # [B', Hkv, Np, 2, D]
    if not np.array_equal(req_host, np.arange(summ.shape[0])):  # several tokens of a request: own page up to itself
        summ = summ[req]  # [T', Hkv, Np, 2, D]
        positions = md.positions_host[g0: md.num_tokens]
        own_min, own_max = summaries.prefix(inputs.layer_idx, md.slots[md.token_to_req_host[g0: md.num_tokens]],
                                            positions)
        rows = torch.arange(len(positions), device=summ.device)
        own = torch.from_numpy(positions.astype(np.int64) // ps).to(summ.device)
        summ[rows, :, own] = torch.stack([own_min, own_max], dim=2)
    # one token per request: it is its request's last position, whose page the pool holds up to it
    valid = torch.arange(summ.shape[2], device=summ.device) < n_pages[g0:].unsqueeze(1)  # [T', Np]
    valid = inputs.mask_outside_window(valid, token_lens[g0:], unit=ps, fill=False)
    scores = page_scores(inputs.q[g0:], summ, valid, mode=mode, topr=topr, sm_scale=inputs.sm_scale)
    return pack_generation_rows(_finish(scores, n_pages[g0:], topk, top_p), inputs, ps)


def _select_pages_per_row(inputs: SelectorInputs, summaries: PageSummaries, *, mode: str, topk: int, topr: int
                          ) -> SparseRuntimeParams:
    """:func:`select_pages` of a step whose generation rows are one token per request (decode
    steps; no sliding window, fixed budget): each row's candidates are every page of its request,
    so no masks, and a selection cannot run short of pages, so no padding. The rows' pages are
    picked by :func:`~kvsieve.kernels.page_topk.plan.page_topk_rows` (one native call for every row on
    the CPU), reading the pool in place; row ``i`` keeps ``min(topk, its pages)``."""
    md = inputs.metadata
    c, ps = md.num_contexts, summaries.page_size
    pool = summaries.pools[inputs.layer_idx]  # [num_blocks, Hkv, S, 2, D]
    g0 = md.generation_rows.start
    q = inputs.q[g0: md.num_tokens]  # [T', Hq, D]
    if topr < q.shape[-1]:
        q = keep_top_channels(q.float().view(q.shape[0], pool.shape[1], -1, q.shape[-1]), topr).flatten(1, 2)
    n_pages = -(-md.kv_lens_host[c: md.num_seqs].astype(np.int64) // ps)
    table = summaries.cache.block_table[md.slots[c: md.num_seqs], : -(-int(n_pages.max()) // pool.shape[2])]
    ks = np.minimum(topk, n_pages)
    sel = page_topk_rows(pool, table, n_pages, q, sm_scale=inputs.sm_scale, mode=mode, ks=ks)
    offsets = [0] * (g0 - inputs.rows.start + 1) + list(accumulate(ks.tolist()))  # context rows: empty segments
    return SparseRuntimeParams(sparse_attn_indices=sel.to(inputs.q.device),
                               sparse_attn_offsets=torch.tensor(offsets, dtype=torch.int32, device=inputs.q.device),
                               sparse_attn_indices_block_size=ps, selected_phases=frozenset({"generation"}))


def select_pages_naive(inputs: SelectorInputs, *, page_size: int, dtype: torch.dtype, mode: str, topk: int,
                        topr: int, top_p: float | None) -> SparseRuntimeParams | None:
    """Plain-PyTorch reference: per request summarize the gathered keys page by page, then per
    generation token and KV head score, softmax, average and pick. Same output as :func:`select_pages`."""
    md = inputs.metadata
    if "generation" not in inputs.phases:
        return None
    hkv, g = inputs.num_kv_heads, inputs.group_size
    rows = []
    width = 1
    for i in range(md.num_contexts, md.num_seqs):
        t0, t1 = inputs.query_range(i)
        keys = inputs.request_keys(i).float()
        for t in range(t0, t1):
            n = -(-(int(md.positions_host[t]) + 1) // page_size)
            first = int(inputs.window_starts(torch.tensor(int(md.positions_host[t]) + 1))) // page_size
            seen = keys[: int(md.positions_host[t]) + 1]  # what this token's own step would have seen
            summ = [(seen[p: p + page_size].amin(0).to(dtype).float(), seen[p: p + page_size].amax(0).to(dtype).float())
                    for p in range(0, seen.shape[0], page_size)]
            per_head = []
            for h in range(hkv):
                qg = inputs.q[t, h * g: (h + 1) * g].float()  # [G, D]
                if topr < qg.shape[1]:
                    mask = torch.zeros(qg.shape[1], dtype=torch.bool)
                    mask[qg.abs().sum(0).topk(topr).indices] = True
                    qg = qg * mask
                kmin = torch.stack([s[0][h] for s in summ[:n]])  # [n, D]
                kmax = torch.stack([s[1][h] for s in summ[:n]])
                if mode == "sign":
                    logits = qg @ torch.where(qg.sum(0) > 0, kmax, kmin).T
                else:
                    logits = torch.stack([torch.maximum(qg * kmin[p], qg * kmax[p]).sum(-1) for p in range(n)], -1)
                logits[:, :first] = float("-inf")  # pages wholly before the window
                mass = torch.softmax(logits * inputs.sm_scale, dim=-1).mean(0)
                score = mass.clone()
                score[:first] = float("-inf")
                score[n - 1] = 2.0
                picked = top_units(score, min(topk, n))
                if top_p is not None:  # newest page first, then by mass, until top_p is reached
                    picked = picked[: top_p_count(mass[picked], top_p)]
                per_head.append(picked)
                width = max(width, picked.numel())
            rows.append(per_head)
    sel = torch.full((len(rows), hkv, width), -1, dtype=torch.int64)
    for t, per_head in enumerate(rows):
        for h, picked in enumerate(per_head):
            sel[t, h, : picked.numel()] = picked
    return pack_generation_rows(sel, inputs, page_size)
