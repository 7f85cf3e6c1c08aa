"""Block selection (NSA / MiniMax-M3 style): per query token, top KV blocks by a block score.

For every query token (prefill and decode, causal) and KV block of ``block_size`` tokens at or
before the query's position, score the block per query head: ``max`` = the largest logit
``q . k * sm_scale`` over the block's visible keys (MiniMax-M3's proxy max-score pass), or
``mean`` = ``q . mean(k) * sm_scale`` over the block's visible keys (NSA-style mean-pooled key).
The query heads of a KV group are reduced by max; the first ``init_blocks`` and the last
``local_blocks`` visible blocks are forced in; the top ``topk_blocks`` blocks per (query token,
KV head) are emitted ascending, ``-1`` padded, at block granularity ``block_size``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..sparse import Capabilities, SelectorInputs, SparseRuntimeParams, SparseSelector, register_selector
from ..sparse.knobs import check_knobs, knob
from ._paged import gather_padded_keys, top_units

__all__ = ["BlockSelectConfig", "BlockSelectSelector", "SCORE_TYPES"]

SCORE_TYPES = ("max", "mean")
_CHUNK_ELEMENTS = 1 << 25  # logits per chunk of query rows (fp32, 128 MiB)


@dataclass(frozen=True)
class BlockSelectConfig:
    """Defaults are MiniMax-M3's (TensorRT-LLM ``minimax_m3``): ``block_size`` 128,
    ``topk_blocks`` 16, ``init_blocks`` 0, ``local_blocks`` 1, ``score_type`` ``"max"``."""

    block_size: int = knob(128, ge=1)
    topk_blocks: int = knob(16, ge=1)
    init_blocks: int = knob(0, ge=0)
    local_blocks: int = knob(1, ge=0)
    score_type: str = knob("max", choices=SCORE_TYPES)

    def __post_init__(self) -> None:
        check_knobs(self, "block_select")
        if self.init_blocks + self.local_blocks > self.topk_blocks:
            raise ValueError(f"block_select: init_blocks + local_blocks must be <= topk_blocks={self.topk_blocks}, "
                             f"got {self.init_blocks} + {self.local_blocks}")


def _force(scores: torch.Tensor, kv_lens: torch.Tensor, cfg: BlockSelectConfig) -> torch.Tensor:
    """``scores [..., nb]`` with ``kv_lens [...]``: invalid blocks ``-inf``, forced blocks ``+inf``."""
    j = torch.arange(scores.shape[-1], device=scores.device)
    n_valid = (-(-kv_lens // cfg.block_size)).unsqueeze(-1)
    forced = (j < cfg.init_blocks) | (j >= n_valid - cfg.local_blocks)
    scores = scores.masked_fill(forced, float("inf"))
    return scores.masked_fill(j >= n_valid, float("-inf"))


def block_select_golden(inputs: SelectorInputs, cfg: BlockSelectConfig) -> SparseRuntimeParams:
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
                    if cfg.score_type == "max":
                        per_head = logits[:, j * bs: (j + 1) * bs].amax(dim=1)
                    else:
                        per_head = qg @ keys[j * bs: min((j + 1) * bs, n), h].mean(dim=0) * inputs.sm_scale
                    score[j] = per_head.max()
                score = _force(score, torch.tensor(n), cfg)
                picked = top_units(score, min(width, n_blocks))
                sel[t - inputs.rows.start, h, : picked.numel()] = picked
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
    scores = scores.scatter(-1, own_blk[:, :, None, None, None].expand(*own.shape, 1), own.unsqueeze(-1))
    return (scores * sm_scale).amax(dim=3)


def block_select(inputs: SelectorInputs, cfg: BlockSelectConfig) -> SparseRuntimeParams:
    """Fast path: the asked requests at once as a padded batch, query rows in chunks."""
    md, bs, dev = inputs.metadata, cfg.block_size, inputs.q.device
    reqs = inputs.requests
    b, hkv, g = len(reqs), inputs.num_kv_heads, inputs.group_size
    lens = md.kv_lens_host[reqs.start: reqs.stop].astype(np.int64)
    nb = -(-int(lens.max()) // bs)
    keys, valid = gather_padded_keys(inputs.cache, inputs.layer_idx, md.slots[reqs.start: reqs.stop], lens)
    keys = F.pad(keys.float().masked_fill(~valid[..., None, None], 0.0), (0, 0, 0, 0, 0, nb * bs - keys.shape[1]))
    starts = md.query_start_host[reqs.start: reqs.stop + 1].astype(np.int64)
    t_max = int(np.diff(starts).max())
    rows = torch.from_numpy(starts[:-1]).unsqueeze(1) + torch.arange(t_max)  # [B, Tmax]
    live = rows < torch.from_numpy(starts[1:]).unsqueeze(1)
    rows = torch.where(live, rows, 0).to(dev)
    live = live.to(dev)
    row_lens = torch.where(live, md.token_kv_lens.to(torch.int64)[rows], 0)  # [B, Tmax]
    width = min(cfg.topk_blocks, nb)
    picked = torch.empty(b, t_max, hkv, width, dtype=torch.int64, device=dev)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, b * hkv * g * nb * bs))
    for c0 in range(0, t_max, chunk):
        c1 = min(c0 + chunk, t_max)
        qp = inputs.q[rows[:, c0:c1]].float().view(b, c1 - c0, hkv, g, -1)
        scores = _block_scores(qp, keys, row_lens[:, c0:c1], cfg, inputs.sm_scale)
        scores = _force(scores, row_lens[:, c0:c1, None].expand(-1, -1, hkv), cfg)
        picked[:, c0:c1] = top_units(scores, width)
    sel = torch.empty(inputs.num_rows, hkv, width, dtype=torch.int64, device=dev)
    sel[rows[live] - inputs.rows.start] = picked[live]
    return SparseRuntimeParams.from_topk(sel, block_size=bs)


@register_selector
class BlockSelectSelector(SparseSelector):
    name = "block_select"
    config_class = BlockSelectConfig
    capabilities = Capabilities()

    def predict_attn(self, inputs: SelectorInputs) -> SparseRuntimeParams:
        return block_select(inputs, self.config)

    def predict_attn_reference(self, inputs: SelectorInputs) -> SparseRuntimeParams:
        """The per-request reference of :meth:`predict_attn`."""
        return block_select_golden(inputs, self.config)
