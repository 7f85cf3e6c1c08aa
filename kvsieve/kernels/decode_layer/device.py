"""The decode layer on the GPU's terms: batched torch with shapes fixed by the cache and the block
table, no host synchronisation, so a decode step can be captured in a CUDA graph and replayed
(the op's contract: ``__init__.py``; the same rules and results as ``decode_layer.c``).

Every shape comes from the arguments' shapes (rows ``B`` of the block table, its width ``W``, the
program's budget), never from their values: no ``.item()``, no ``.cpu()``, no data-dependent
indexing. A row of length 0 (vLLM's padding rows in a captured batch) reads nothing, writes no state
and gets zeros. Where the native kernel walks the row's blocks, this path reads all ``W`` of them
and masks, so it costs ``O(W * block_size)`` per row for the rules that score every position
(``tokens_exact``, ``blocks_exact``, ``indexer``) and ``O(W * block_size / page)`` for the page rules.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .plan import DecodeProgram, IndexerStep

__all__ = ["decode_layer_device"]


def _top_stable(score: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index [..., k], ok [..., k])``: the ``k`` best of ``score [..., n]`` (ties to the lower index,
    ``-inf`` = not a candidate; ``ok`` false there), one int64 key per entry."""
    n = score.shape[-1]
    bits = torch.where(score == 0, torch.zeros_like(score), score).float().view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) + 2**31  # [0, 2**32): larger value, larger key
    keys = ordered * 2**31 + (2**31 - 1 - torch.arange(n, device=score.device))
    idx = keys.topk(k, dim=-1).indices
    return idx, torch.gather(score, -1, idx) > float("-inf")


def _positions(units: torch.Tensor, ok: torch.Tensor, unit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Units ``[B, H, k]`` of ``unit`` positions as positions ``[B, H, k * unit]`` and their ``ok``."""
    pos = units.unsqueeze(-1) * unit + torch.arange(unit, device=units.device)
    return pos.flatten(-2), ok.unsqueeze(-1).expand(*ok.shape, unit).flatten(-2)


def _gather(cache: torch.Tensor, table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """fp32 ``[B, H, S, D]``: ``cache [num_blocks, H, block_size, D]`` at positions ``pos [B, H, S]``
    of each row's blocks ``table [B, W]`` (positions past the table read its last block, masked later)."""
    b, h, s = pos.shape
    bs = cache.shape[2]
    blk = torch.gather(table, 1, (pos // bs).clamp(max=table.shape[1] - 1).flatten(1)).view(b, h, s)
    head = torch.arange(h, device=pos.device)[None, :, None].expand(b, h, s)
    return cache[blk, head, pos % bs].float()


def _page_summaries(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """fp32 ``[B, Hkv, W * S, 2, D]``: every page of each row's blocks (``pool [num_blocks, Hkv, S, 2, D]``)."""
    b, w = table.shape
    _, hkv, sub, two, d = pool.shape
    return pool[table].float().permute(0, 2, 1, 3, 4, 5).reshape(b, hkv, w * sub, two, d)


def _refresh_newest_page(program: DecodeProgram, k: torch.Tensor, table: torch.Tensor, lens: torch.Tensor) -> None:
    """The newest page's summary widened by the row's new token (opened by it: the token alone);
    rows of length 0 write back what was there."""
    pool, ps, bs = program.pool, program.page_size, k.shape[2]
    last = (lens - 1).clamp(min=0)
    blk = torch.gather(table, 1, (last // bs)[:, None])[:, 0]
    sub = (last % bs) // ps
    new = k[blk, :, last % bs].float()  # [B, Hkv, D]
    old = pool[blk, :, sub].float()  # [B, Hkv, 2, D]
    opens = (last % ps == 0)[:, None, None]
    lo = torch.where(opens, new, torch.minimum(old[:, :, 0], new))
    hi = torch.where(opens, new, torch.maximum(old[:, :, 1], new))
    stale = ~opens  # a NaN key, or one already in the page, stays NaN (as torch's amin/amax propagate it)
    lo = lo.masked_fill(new.isnan() | (stale & old[:, :, 0].isnan()), float("nan"))
    hi = hi.masked_fill(new.isnan() | (stale & old[:, :, 1].isnan()), float("nan"))
    live = (lens > 0)[:, None, None, None]
    pool[blk, :, sub] = torch.where(live, torch.stack([lo, hi], dim=2), old).to(pool.dtype)


def _select(program: DecodeProgram, k: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, qg: torch.Tensor,
            sm_scale: float, index: IndexerStep | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pos [B, Hkv, S], ok [B, Hkv, S])``: the positions each (row, KV head) attends."""
    p, unit = program, program.unit
    b, hkv = qg.shape[:2]
    dev = lens.device
    w, bs = table.shape[1], k.shape[2]
    n_units = (lens + unit - 1) // unit  # [B]
    cap = -(-w * bs // unit)  # units the table holds (the last one maybe partial)
    kk = min(p.units, cap)
    if p.kind == "streaming":
        sink = lens.clamp(max=p.num_sink)[:, None]
        window = p.units - p.num_sink
        pos = torch.cat([torch.arange(p.num_sink, device=dev).expand(b, -1),
                         lens[:, None] - window + torch.arange(window, device=dev)], dim=1)
        ok = torch.cat([pos[:, :p.num_sink] < sink, pos[:, p.num_sink:] >= sink], dim=1) & (pos < lens[:, None])
        return pos.clamp(min=0)[:, None].expand(-1, hkv, -1), ok[:, None].expand(-1, hkv, -1)
    all_pos = torch.arange(w * bs, device=dev)
    visible = all_pos < lens[:, None]  # [B, L]
    pad = cap * unit - w * bs  # positions past the table, up to whole units (never visible)
    if p.kind == "indexer":
        keys = p.index_keys[table].float().flatten(1, 2)  # [B, L, Di]
        score = torch.einsum("bhd,bld->bhl", index.q, keys).relu()
        score = torch.einsum("bh,bhl->bl", index.weights, score).masked_fill(~visible, float("-inf"))
        idx, ok = _top_stable(score, min(p.units, w * bs))
        return idx[:, None].expand(-1, hkv, -1), ok[:, None].expand(-1, hkv, -1)
    u = torch.arange(cap, device=dev)
    live = u < n_units[:, None]  # [B, cap]
    if p.kind == "pages":
        summ = _page_summaries(p.pool, table)  # [B, Hkv, P, 2, D]
        if p.mode == "bound":
            logits = (torch.einsum("bhgd,bhpd->bhgp", qg.clamp(max=0), summ[:, :, :, 0])
                      + torch.einsum("bhgd,bhpd->bhgp", qg.clamp(min=0), summ[:, :, :, 1]))
        else:  # sign: each channel's max where the group's summed query channel is positive, else its min
            use_max = (qg.sum(2) > 0)[:, :, None, :]  # [B, Hkv, 1, D]
            logits = torch.einsum("bhgd,bhpd->bhgp", qg, torch.where(use_max, summ[:, :, :, 1], summ[:, :, :, 0]))
        logits = (logits * sm_scale).masked_fill(~live[:, None, None], float("-inf"))
        score = torch.softmax(logits, dim=-1).mean(2).nan_to_num(0.0)
        score = torch.where(u == (n_units - 1)[:, None, None], 2.0, score).masked_fill(~live[:, None], float("-inf"))
    elif p.kind == "tokens_exact" or p.kind == "blocks_exact":
        pos = all_pos[None, None].expand(b, hkv, -1)
        keys = _gather(k, table, pos)  # [B, Hkv, L, D]
        logits = (torch.einsum("bhgd,bhld->bhgl", qg, keys) * sm_scale).masked_fill(~visible[:, None, None],
                                                                                   float("-inf"))
        logits = F.pad(logits, (0, pad), value=float("-inf"))  # [B, Hkv, G, cap * unit]
        if p.kind == "tokens_exact":
            mass = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(2)  # [B, Hkv, L]
            score = mass.view(b, hkv, cap, unit).sum(-1).masked_fill(~live[:, None], float("-inf"))
        else:
            per = logits.view(b, hkv, -1, cap, unit)
            if p.mode == "max":
                score = per.amax(-1).amax(2)
            else:
                seen = F.pad(visible, (0, pad)).view(b, 1, 1, cap, unit)
                score = (per.masked_fill(~seen, 0.0).sum(-1) / seen.sum(-1).clamp(min=1)).amax(2)
            score = score.masked_fill(~live[:, None], float("-inf"))
    else:  # blocks_bound: the pages of each block, the group's largest bound
        per = unit // p.page_size
        summ = F.pad(_page_summaries(p.pool, table), (0, 0, 0, 0, 0, cap * per - w * bs // p.page_size))
        pages = (lens + p.page_size - 1) // p.page_size
        seen = (torch.arange(summ.shape[2], device=dev) < pages[:, None])[:, None, :, None]  # [B, 1, P, 1]
        kmin = summ[:, :, :, 0].masked_fill(~seen, float("inf")).view(b, hkv, cap, per, -1).amin(3)
        kmax = summ[:, :, :, 1].masked_fill(~seen, float("-inf")).view(b, hkv, cap, per, -1).amax(3)
        kmin, kmax = kmin.masked_fill(kmin.isinf(), 0.0), kmax.masked_fill(kmax.isinf(), 0.0)
        bound = (torch.einsum("bhgd,bhcd->bhgc", qg.clamp(max=0), kmin)
                 + torch.einsum("bhgd,bhcd->bhgc", qg.clamp(min=0), kmax))
        score = (bound * sm_scale).amax(2).masked_fill(~live[:, None], float("-inf"))
    if p.kind in ("blocks_exact", "blocks_bound"):
        forced = (u < p.init_units)[None] | (u >= (n_units - p.local_units)[:, None])
        score = torch.where(forced[:, None] & live[:, None], float("inf"), score)
    units, ok = _top_stable(score, kk)
    return _positions(units, ok, unit)


def decode_layer_device(k: torch.Tensor, v: torch.Tensor, program: DecodeProgram, table: torch.Tensor,
                        lens: torch.Tensor, q: torch.Tensor, out: torch.Tensor, *, sm_scale: float,
                        index: IndexerStep | None = None) -> torch.Tensor:
    """The decode rows of one layer, arguments as :meth:`~.native.DecodeLayerCall.run` but all on the
    device: ``table [B, W]`` int32/int64, ``lens [B]`` int (0 = a padding row), ``q``/``out [B, Hq, D]``
    (``out`` written in its dtype), ``index`` the indexer's step inputs; the program's pools are written
    as the kernel writes them. Returns ``attended [B, Hkv]`` int64 on the device."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    table, lens = table.long(), lens.long()
    if program.kind in ("pages", "blocks_bound"):
        _refresh_newest_page(program, k, table, lens)
    if program.kind == "indexer":
        last = (lens - 1).clamp(min=0)
        blk = torch.gather(table, 1, (last // k.shape[2])[:, None])[:, 0]
        off = last % k.shape[2]
        keep = program.index_keys[blk, off]
        program.index_keys[blk, off] = torch.where((lens > 0)[:, None], index.keys.to(keep.dtype), keep)
    qg = q.float().view(b, hkv, hq // hkv, d)
    pos, ok = _select(program, k, table, lens, qg, sm_scale, index)
    ok = ok & (pos < lens[:, None, None])
    logits = torch.einsum("bhgd,bhsd->bhgs", qg, _gather(k, table, pos)) * sm_scale
    prob = torch.softmax(logits.masked_fill(~ok[:, :, None], float("-inf")), dim=-1).nan_to_num(0.0)
    out.copy_(torch.einsum("bhgs,bhsd->bhgd", prob, _gather(v, table, pos)).reshape(b, hq, d))
    return ok.sum(-1)
