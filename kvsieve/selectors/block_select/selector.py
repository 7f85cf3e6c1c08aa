"""Block selection (NSA / MiniMax-M3 style): per query token, top KV blocks by a block score.

For every query token (prefill and decode, causal) and KV block of ``block_size`` tokens at or
before the query's position, score the block per query head: ``max`` = the largest logit
``q . k * sm_scale`` over the block's visible keys (MiniMax-M3's proxy max-score pass), or
``mean`` = ``q . mean(k) * sm_scale`` over the block's visible keys (NSA-style mean-pooled key).
The query heads of a KV group are reduced by max; the first ``init_blocks`` and the last
``local_blocks`` visible blocks are forced in; the top ``topk_blocks`` blocks per (query token,
KV head) are emitted ascending, ``-1`` padded, at block granularity ``block_size``. On a
sliding-window layer the blocks lying wholly before a query's window are not candidates (forced
``init_blocks`` there included; :meth:`~kvsieve.sparse.SelectorInputs.mask_outside_window`).

``scoring`` chooses where the block scores come from:

* ``exact`` (default): from every visible key, as above (reads ``O(context)`` keys per query row).
* ``summary``: from cached per-block key summaries, the element-wise min and max of K over the
  block (the page-summary aux pool of :mod:`..common.page_summary`, fp32, at page size
  ``gcd(block_size, tokens_per_block)``, refreshed on every append like Quest's). A block scores
  ``sum_d max(q_d * min_d, q_d * max_d) * sm_scale``, an upper bound of its ``max`` score (Quest's
  bound), so it needs ``score_type="max"``. The query's own block is summarized over its positions
  up to the query only (complete pages from the pool, its own page from the cache), so several
  query tokens of one request in a step choose what one-token steps would. Reads ``O(context /
  page)`` summaries per query row instead of every key. On the CPU the rows' selection is one native
  call (:mod:`kvsieve.kernels.block_bound`) where it applies (no ``top_p``, no window).

Adaptive budget (``top_p``, beyond NSA/MiniMax-M3; Twilight, arXiv 2502.02770): a block's
estimated mass is the softmax, over the query's visible blocks, of its group-max block score
(the score it is ranked by, already scaled by ``sm_scale``). Per (query token, KV head) the
forced blocks come first, then blocks in descending score, and the list stops once the mass
before the next block reaches ``top_p`` (the forced blocks are always kept, their mass counted);
never more than ``topk_blocks`` blocks.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ...kernels.common.native import NativeUnavailable
from ...kernels.decode_layer.plan import DecodeProgram
from ...metadata import KVCacheManager
from ...sparse import BudgetKnob, Capabilities, SelectorInputs, SparseRuntimeParams, register_selector
from ...sparse.knobs import KnobError, check_knobs, knob
from ..common.page_selector import PageSelectorBase
from ..common.page_summary import PageSummaries, bound_query
from ..common.paged import (drop_empty_columns, gather_padded_keys, top_p_count, top_p_cut, top_p_knob, top_units,
                            top_units_topk)

__all__ = ["BlockSelectConfig", "BlockSelectSelector", "SCORE_TYPES", "SCORINGS"]

SCORE_TYPES = ("max", "mean")
SCORINGS = ("exact", "summary")
_CHUNK_ELEMENTS = 1 << 25  # logits per chunk of query rows (fp32, 128 MiB)
_CHUNK_ROWS = 512  # query rows per chunk at most: a chunk scores the blocks its last row sees


@dataclass(frozen=True)
class BlockSelectConfig:
    """Defaults are MiniMax-M3's (TensorRT-LLM ``minimax_m3``): ``block_size`` 128,
    ``topk_blocks`` 16, ``init_blocks`` 0, ``local_blocks`` 1, ``score_type`` ``"max"``.

    ``scoring`` defaults to ``"exact"``: MiniMax-M3's and NSA's definition of the block score, the
    one the recall figures were measured with; ``"summary"`` (min/max key summaries, Quest's
    bound) is the cheaper opt-in approximation, for ``score_type="max"`` only. ``top_p``
    (``None``) turns ``topk_blocks`` into a cap (module docstring)."""

    block_size: int = knob(128, ge=1)
    topk_blocks: int = knob(16, ge=1)
    init_blocks: int = knob(0, ge=0)
    local_blocks: int = knob(1, ge=0)
    score_type: str = knob("max", choices=SCORE_TYPES)
    scoring: str = knob("exact", choices=SCORINGS, doc="where block scores come from")
    top_p: float | None = top_p_knob()

    def __post_init__(self) -> None:
        check_knobs(self, "block_select")
        if self.scoring == "summary" and self.score_type != "max":
            raise KnobError(f"block_select.scoring must be 'exact' for score_type={self.score_type!r}, got 'summary' "
                            "(it bounds each block's max logit from its min/max keys)")
        if self.init_blocks + self.local_blocks > self.topk_blocks:
            raise KnobError(f"block_select.init_blocks + local_blocks must be <= topk_blocks={self.topk_blocks}, "
                             f"got {self.init_blocks} + {self.local_blocks}")


def _force(scores: torch.Tensor, kv_lens: torch.Tensor, cfg: BlockSelectConfig) -> torch.Tensor:
    """``scores [..., nb]`` with ``kv_lens [...]``: invalid blocks ``-inf``, forced blocks ``+inf``."""
    j = torch.arange(scores.shape[-1], device=scores.device)
    n_valid = (-(-kv_lens // cfg.block_size)).unsqueeze(-1)
    forced = (j < cfg.init_blocks) | (j >= n_valid - cfg.local_blocks)
    scores = scores.masked_fill(forced, float("inf"))
    return scores.masked_fill(j >= n_valid, float("-inf"))


def block_select_naive(inputs: SelectorInputs, cfg: BlockSelectConfig) -> SparseRuntimeParams:
    """Plain-PyTorch reference: per request, token, KV head and block, in loops."""
    md, bs = inputs.metadata, cfg.block_size
    g, reqs = inputs.group_size, inputs.requests
    width = min(cfg.topk_blocks, -(-int(md.kv_lens_host[reqs.start: reqs.stop].max()) // bs))
    sel = torch.full((inputs.num_rows, inputs.num_kv_heads, width), -1, dtype=torch.int64)
    for i in reqs:
        t0, t1 = inputs.query_range(i)
        keys = inputs.request_keys(i).float()
        for t in range(t0, t1):
            n = int(md.positions_host[t]) + 1
            n_blocks = -(-n // bs)
            for h in range(inputs.num_kv_heads):
                qg = inputs.q[t, h * g: (h + 1) * g].float()  # [G, D]
                logits = qg @ keys[:n, h].T * inputs.sm_scale  # [G, n]
                score = torch.empty(n_blocks)
                for j in range(n_blocks):
                    if cfg.scoring == "summary":
                        blk = keys[j * bs: min((j + 1) * bs, n), h]
                        per_head = torch.maximum(qg * blk.amin(0), qg * blk.amax(0)).sum(-1) * inputs.sm_scale
                    elif cfg.score_type == "max":
                        per_head = logits[:, j * bs: (j + 1) * bs].amax(dim=1)
                    else:
                        per_head = qg @ keys[j * bs: min((j + 1) * bs, n), h].mean(dim=0) * inputs.sm_scale
                    score[j] = per_head.max()
                forced_scores = inputs.mask_outside_window(_force(score, torch.tensor(n), cfg), torch.tensor(n),
                                                           unit=bs)
                mass = torch.softmax(score.masked_fill(torch.isneginf(forced_scores), float("-inf")), dim=0)
                picked = top_units(forced_scores, min(width, n_blocks))
                if cfg.top_p is not None:  # forced blocks (always kept) first, then by score, until top_p
                    forced = int(torch.isposinf(forced_scores[picked.clamp(min=0)]).sum())
                    picked = picked[: max(forced, top_p_count(mass[picked], cfg.top_p))]
                sel[t - inputs.rows.start, h, : picked.numel()] = picked
    if cfg.top_p is not None:
        sel = drop_empty_columns(sel)
    return SparseRuntimeParams.from_topk(sel.to(inputs.q.device), block_size=bs)


def _block_scores(qp: torch.Tensor, keys: torch.Tensor, row_lens: torch.Tensor, cfg: BlockSelectConfig,
                  sm_scale: float) -> torch.Tensor:
    """``[B, Tc, Hkv, nb]`` group-max block scores (before forcing).

    ``qp [B, Tc, Hkv, G, D]`` fp32, ``keys [B, L, Hkv, D]`` fp32 with ``L`` a multiple of the
    block size (zero past each request), ``row_lens [B, Tc]`` visible keys per row (0 = padding).
    """
    b, length, hkv, d = keys.shape
    bs = cfg.block_size
    nb = length // bs
    pos = torch.arange(length, device=keys.device)
    if cfg.score_type == "max":
        logits = torch.einsum("bthgd,blhd->bthgl", qp, keys) * sm_scale
        visible = pos < row_lens[..., None]  # [B, Tc, L]
        logits = logits.masked_fill(~visible[:, :, None, None, :], float("-inf"))
        return logits.view(*logits.shape[:-1], nb, bs).amax(dim=-1).amax(dim=3)
    # mean: full-block means, and the query's own (partial) block from within-block prefix sums
    cum = keys.view(b, nb, bs, hkv, d).cumsum(dim=2)
    means = cum[:, :, -1] / bs  # [B, nb, Hkv, D]; only whole blocks lie before a row's own block
    scores = torch.einsum("bthgd,bnhd->bthgn", qp, means)
    last = (row_lens - 1).clamp(min=0)  # [B, Tc] position of the row's newest key
    own_blk, own_off = last // bs, last % bs
    bidx = torch.arange(b, device=keys.device).unsqueeze(1)
    own_mean = cum[bidx, own_blk, own_off] / (own_off + 1)[..., None, None].to(cum.dtype)  # [B, Tc, Hkv, D]
    own = torch.einsum("bthgd,bthd->bthg", qp, own_mean)
    return (_with_own_block(scores, own, own_blk) * sm_scale).amax(dim=3)


def _with_own_block(scores: torch.Tensor, own: torch.Tensor, own_blk: torch.Tensor) -> torch.Tensor:
    """``scores [B, Tc, Hkv, G, nb]`` with block ``own_blk [B, Tc]`` replaced by ``own [B, Tc, Hkv, G]``."""
    return scores.scatter(-1, own_blk[:, :, None, None, None].expand(*own.shape, 1), own.unsqueeze(-1))


def _bound_scores(qp: torch.Tensor, bounds: torch.Tensor, own: torch.Tensor, own_blk: torch.Tensor,
                  sm_scale: float) -> torch.Tensor:
    """``[B, Tc, Hkv, nb]`` group-max Quest bounds: ``qp [B, Tc, Hkv, G, D]``; ``bounds [B, nb, Hkv,
    2 * D]`` each block's min and max keys side by side; ``own [B, Tc, Hkv, 2 * D]`` each row's own
    block summarized up to itself, at block ``own_blk [B, Tc]``. All fp32. One product of
    :func:`bound_query` with each row, the group max taken in the product's own layout before the
    own block's score (group max too) is put in place; the scale is applied after the group max (a
    positive scale commutes with it exactly)."""
    qcat = bound_query(qp)  # [B, Tc, Hkv, G, 2D]
    scores = torch.einsum("bthgd,bnhd->bhtgn", qcat, bounds).amax(dim=3).permute(0, 2, 1, 3)  # [B, Tc, Hkv, nb]
    own_scores = torch.einsum("bthgd,bthd->bthg", qcat, own).amax(dim=3)  # [B, Tc, Hkv]
    own_at = own_blk[:, :, None, None].expand(*own_scores.shape, 1)
    return scores.scatter(-1, own_at, own_scores.unsqueeze(-1)).mul_(sm_scale)


def _padded_rows(inputs: SelectorInputs) -> tuple[np.ndarray, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The asked requests' query rows as a padded batch: token indices ``[B, Tmax]`` (numpy, 0 on
    padding; and as a tensor on the device), ``live [B, Tmax]`` bool and ``row_lens [B, Tmax]``
    visible keys per row (0 on padding)."""
    md, reqs, dev = inputs.metadata, inputs.requests, inputs.q.device
    starts = md.query_start_host[reqs.start: reqs.stop + 1].astype(np.int64)
    rows = starts[:-1, None] + np.arange(int(np.diff(starts).max()))  # [B, Tmax]
    live = rows < starts[1:, None]
    rows = np.where(live, rows, 0)
    rows_t, live_t = torch.from_numpy(rows).to(dev), torch.from_numpy(live).to(dev)
    return rows, rows_t, live_t, torch.where(live_t, md.token_kv_lens.to(torch.int64)[rows_t], 0)


def _select(inputs: SelectorInputs, cfg: BlockSelectConfig, nb: int, padded: tuple[torch.Tensor, ...],
            score_rows: Callable[[int, int, int], torch.Tensor], row_cost: int) -> SparseRuntimeParams:
    """Score the padded query rows (``padded`` = ``(rows, live, row_lens)`` of :func:`_padded_rows`)
    in chunks of at most ``_CHUNK_ROWS`` and ``~_CHUNK_ELEMENTS / row_cost`` rows (``row_cost``: a row's
    elements over all ``nb`` blocks) with ``score_rows(c0, c1, nb_c) -> [B, c1 - c0, Hkv, nb_c]``, the
    chunk's first ``nb_c`` blocks (those its rows can see: a prompt's early rows skip the blocks past
    them), force and pick, and pack the asked rows."""
    dev, hkv, bs = inputs.q.device, inputs.num_kv_heads, cfg.block_size
    rows, live, row_lens = padded
    b, t_max = rows.shape
    width = min(cfg.topk_blocks, nb)
    picked = torch.full((b, t_max, hkv, width), -1, dtype=torch.int64, device=dev)
    chunk = min(_CHUNK_ROWS, max(1, _CHUNK_ELEMENTS // max(1, b * row_cost)))
    for c0 in range(0, t_max, chunk):
        c1 = min(c0 + chunk, t_max)
        nb_c = max(1, -(-int(row_lens[:, c0:c1].max()) // bs))
        lens = row_lens[:, c0:c1, None].expand(-1, -1, hkv)
        raw = score_rows(c0, c1, nb_c)
        scores = inputs.mask_outside_window(_force(raw, lens, cfg), lens, unit=bs)
        part = picked[:, c0:c1, :, :min(width, nb_c)]
        part[:] = top_units_topk(scores, part.shape[-1])
        if cfg.top_p is not None:
            prob = torch.softmax(raw.masked_fill(torch.isneginf(scores), float("-inf")), dim=-1).nan_to_num(0.0)
            cut = top_p_cut(part, torch.gather(prob, -1, part.clamp(min=0)), torch.ones_like(prob[..., 0]), cfg.top_p)
            forced = torch.isposinf(torch.gather(scores, -1, part.clamp(min=0))) & (part >= 0)
            part[:] = torch.where(forced, part, cut)  # forced blocks are always kept
    sel = torch.empty(inputs.num_rows, hkv, width, dtype=torch.int64, device=dev)
    sel[rows[live] - inputs.rows.start] = picked[live]
    if cfg.top_p is not None:
        sel = drop_empty_columns(sel)
    return SparseRuntimeParams.from_topk(sel, block_size=cfg.block_size)


def _row_queries(inputs: SelectorInputs, rows: torch.Tensor) -> torch.Tensor:
    """fp32 ``[B, Tc, Hkv, G, D]`` queries of the padded rows ``rows [B, Tc]``."""
    return inputs.q[rows].float().view(*rows.shape, inputs.num_kv_heads, inputs.group_size, -1)


def block_select(inputs: SelectorInputs, cfg: BlockSelectConfig) -> SparseRuntimeParams:
    """Fast path of ``scoring="exact"``: the asked requests at once as a padded batch, query rows in chunks."""
    md, bs, reqs = inputs.metadata, cfg.block_size, inputs.requests
    lens = md.kv_lens_host[reqs.start: reqs.stop].astype(np.int64)
    nb = -(-int(lens.max()) // bs)
    keys, valid = gather_padded_keys(inputs.cache, inputs.layer_idx, md.slots[reqs.start: reqs.stop], lens)
    keys = F.pad(keys.float().masked_fill(~valid[..., None, None], 0.0), (0, 0, 0, 0, 0, nb * bs - keys.shape[1]))
    _, rows, live, row_lens = _padded_rows(inputs)

    def score_rows(c0: int, c1: int, nb_c: int) -> torch.Tensor:
        return _block_scores(_row_queries(inputs, rows[:, c0:c1]), keys[:, :nb_c * bs], row_lens[:, c0:c1], cfg,
                             inputs.sm_scale)

    return _select(inputs, cfg, nb, (rows, live, row_lens), score_rows, inputs.q.shape[1] * nb * bs)


def block_select_summary(inputs: SelectorInputs, cfg: BlockSelectConfig, summaries: PageSummaries
                         ) -> SparseRuntimeParams:
    """Fast path of ``scoring="summary"``: block bounds from the page-summary pool (pages of
    ``summaries.page_size`` dividing ``block_size``), each row's own block up to itself."""
    md, bs, reqs = inputs.metadata, cfg.block_size, inputs.requests
    slots = md.slots[reqs.start: reqs.stop]
    lens = md.kv_lens_host[reqs.start: reqs.stop].astype(np.int64)
    nb, r = -(-int(lens.max()) // bs), bs // summaries.page_size
    pmin, pmax = (F.pad(x, (0, 0, 0, 0, 0, nb * r - x.shape[1]))  # [B, nb * r, Hkv, D]; past a length: unread
                  for x in summaries.read(inputs.layer_idx, slots, lens))
    b, _, hkv, d = pmin.shape
    bounds = torch.cat([pmin.view(b, nb, r, hkv, d).amin(2), pmax.view(b, nb, r, hkv, d).amax(2)], dim=-1)
    rows_host, rows, live, row_lens = _padded_rows(inputs)
    last = (row_lens - 1).clamp(min=0)
    own_blk, own_page = last // bs, last // summaries.page_size
    pages = own_blk.unsqueeze(-1) * r + torch.arange(r, device=rows.device)  # [B, Tmax, r] the own block's pages
    before = (pages < own_page.unsqueeze(-1))[..., None, None]  # its complete pages before the row's own page
    bidx = torch.arange(b, device=rows.device)[:, None, None]
    own_min = pmin[bidx, pages].masked_fill(~before, float("inf")).amin(2)  # [B, Tmax, Hkv, D]
    own_max = pmax[bidx, pages].masked_fill(~before, float("-inf")).amax(2)
    live_rows = rows_host[live.cpu().numpy()]
    tmin, tmax = summaries.prefix(inputs.layer_idx, md.slots[md.token_to_req_host[live_rows]], md.positions_host[live_rows])
    own_min[live], own_max[live] = torch.minimum(own_min[live], tmin), torch.maximum(own_max[live], tmax)
    own = torch.where(live[..., None, None], torch.cat([own_min, own_max], dim=-1), 0.0)  # padding: finite
    native = _bound_select_native(inputs, cfg, bounds, own, (rows, live, row_lens))
    if native is not None:
        return native

    def score_rows(c0: int, c1: int, nb_c: int) -> torch.Tensor:
        return _bound_scores(_row_queries(inputs, rows[:, c0:c1]), bounds[:, :nb_c], own[:, c0:c1],
                             own_blk[:, c0:c1], inputs.sm_scale)

    return _select(inputs, cfg, nb, (rows, live, row_lens), score_rows, 2 * inputs.q.shape[1] * nb)


def _bound_select_native(inputs: SelectorInputs, cfg: BlockSelectConfig, bounds: torch.Tensor, own: torch.Tensor,
                         padded: tuple[torch.Tensor, ...]) -> SparseRuntimeParams | None:
    """:func:`block_select_summary`'s selection in one native call (:mod:`kvsieve.kernels.block_bound`:
    no ``[rows x blocks]`` scores beyond a row's), or ``None`` where it does not apply: ``top_p``, a
    sliding window, queries off the CPU or past the kernel's shapes, or no library. ``bounds [B, nb,
    Hkv, 2 * D]`` and ``own [B, Tmax, Hkv, 2 * D]`` as there; ``padded`` = ``(rows, live, row_lens)``."""
    from ...kernels.block_bound.native import block_bound_topk_native, supports_block_bound

    if cfg.top_p is not None or inputs.window is not None or not supports_block_bound(inputs.q, inputs.num_kv_heads):
        return None
    rows, live, row_lens = padded
    req = torch.arange(rows.shape[0], device=rows.device)[:, None].expand_as(rows)[live]
    width = min(cfg.topk_blocks, bounds.shape[1])
    try:
        picked = block_bound_topk_native(bounds, own[live], inputs.q[rows[live]], req, row_lens[live],
                                         block_size=cfg.block_size, k=width, init_units=cfg.init_blocks,
                                         local_units=cfg.local_blocks, sm_scale=inputs.sm_scale)
    except NativeUnavailable:
        return None
    sel = torch.empty(inputs.num_rows, inputs.num_kv_heads, width, dtype=torch.int32)
    sel[rows[live] - inputs.rows.start] = picked
    return SparseRuntimeParams.from_topk(sel, block_size=cfg.block_size)


@register_selector
class BlockSelectSelector(PageSelectorBase):
    """With ``scoring="summary"`` the page-summary pool of :class:`PageSelectorBase` (its
    ``on_append``/``on_compacted`` refresh) holds fp32 min/max keys per page of
    ``gcd(block_size, tokens_per_block)`` tokens; with ``"exact"`` no pool is kept."""

    name = "block_select"
    config_class = BlockSelectConfig
    capabilities = Capabilities(sliding_window=True, per_kv_head=True)
    budget = BudgetKnob("topk_blocks", unit="blocks", unit_size_field="block_size")

    def summaries_of(self, cache: KVCacheManager, head_dim: int) -> PageSummaries:
        if self._summaries is None or self._summaries.cache is not cache:
            self._summaries = PageSummaries(cache, math.gcd(self.config.block_size, cache.tokens_per_block), torch.float32)
        return self._summaries

    def on_append(self, inputs: SelectorInputs) -> None:
        if self.config.scoring == "summary":
            super().on_append(inputs)

    def on_attach(self, inputs: SelectorInputs, requests: np.ndarray) -> None:
        if self.config.scoring == "summary":
            super().on_attach(inputs, requests)

    def on_compacted(self, inputs: SelectorInputs, kept: list[torch.Tensor]) -> None:
        if self.config.scoring == "summary":
            super().on_compacted(inputs, kept)

    def predict_attn(self, inputs: SelectorInputs) -> SparseRuntimeParams:
        if self.config.scoring == "summary":
            return block_select_summary(inputs, self.config, self.summaries(inputs))
        return block_select(inputs, self.config)

    def predict_attn_naive(self, inputs: SelectorInputs) -> SparseRuntimeParams:
        """The per-request reference of :meth:`predict_attn`."""
        return block_select_naive(inputs, self.config)

    def decode_program(self, cache: KVCacheManager, layer_idx: int, head_dim: int) -> DecodeProgram | None:
        c = self.config
        if c.top_p is not None:
            return None
        forced = {"units": c.topk_blocks, "unit": c.block_size, "init_units": c.init_blocks,
                  "local_units": c.local_blocks}
        if c.scoring == "exact":
            return DecodeProgram("blocks_exact", mode=c.score_type, **forced)
        summaries = self.summaries_of(cache, head_dim)
        return DecodeProgram("blocks_bound", pool=summaries.pools[layer_idx], page_size=summaries.page_size, **forced)
