"""The torch backend's shared-gather prefill on CPU: query tokens grouped by the runs they read,
and each group's attention split into the columns every member sees and the few it does not.

Consecutive query tokens of one request that name the same runs of positions (a prefill's dense
rows, a query block of a block-sparse prefill) form a group. Its members differ only in their
length (causality), so a selected run that ends at or before the group's shortest length is read
whole by every member: those *full* runs go through PyTorch's fused CPU flash kernel with no mask,
the group's query heads folded into its query rows (the ``g`` heads of a KV head share K/V). The
*partial* runs (the diagonal: starting before the group's longest length, not full) are a small
masked call. The two ``(out, lse)`` are merged by log-sum-exp. Nothing here builds a tensor per
(token, position): the per-token work is per run, ``[Hkv, n, U]``.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

__all__ = ["Groups", "flash_cpu", "group_tokens", "split_prefill"]

# ``rows(name, flat, index)``: ``flat.index_select(0, index)`` as fp32, into the backend's reused buffer ``name``
RowGather = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]


class Groups(NamedTuple):
    """Tokens ``[0, n)`` of a chunk in ``count`` groups of consecutive tokens sharing one gather."""

    gid: torch.Tensor  # int64 [n]: each token's group
    slot: torch.Tensor  # int64 [n]: each token's place in its group
    count: int  # G
    largest: int  # tokens in the largest group
    head: torch.Tensor  # int64 [G]: each group's first token
    last: torch.Tensor  # int64 [G]: each group's last token


def flash_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` (no causal mask, no dropout):
    q fp32 ``[B, H, L, D]``, k/v ``[B, H, S, D]``/``[B, H, S, Dv]``, ``bias`` fp32 ``[B, H, L, S]``
    (0 or ``-inf``) or ``None``. Returns out ``[B, H, L, Dv]`` and the natural-log lse ``[B, H, L]``;
    with no keys (``S = 0``, where the kernel dies of a floating-point exception) out 0 and lse
    ``inf``, the convention for a query that attends nothing. A row whose bias is all ``-inf``
    comes back as out 0 and lse 0: callers mask such rows themselves."""
    if k.shape[-2] == 0:
        return q.new_zeros(*q.shape[:-1], v.shape[-1]), q.new_full(q.shape[:-1], torch.inf)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias,
                                                                        scale=scale)[:2]
    return o, lse


def group_tokens(req: torch.Tensor, raw: torch.Tensor, max_groups: int, more: bool) -> tuple[Groups | None, int]:
    """Groups of consecutive tokens of one request that name the same runs.

    Args:
        req: int64 ``[n]`` each token's request (batch row).
        raw: int64 ``[Hkv, n, U]`` each token's run starts as its selection names them (before
            masking by length; negative for padding).
        max_groups: at most this many groups; the tokens of later groups are left out.
        more: whether the phase goes on past these tokens. The last group may then be cut short;
            when it is shorter than the largest (a chunk of 337 rows of 128-token query blocks), it
            is left out too, so the next chunk starts with a whole group (and later chunks stay
            aligned to groups).

    Returns:
        The groups of the first ``n'`` tokens (``None`` when every token is its own group) and ``n'``.
    """
    n = req.numel()
    if n <= 1:
        return None, n
    first = torch.ones(n, dtype=torch.bool, device=req.device)
    first[1:] = req[1:] != req[:-1]
    if raw.shape[2]:
        first[1:] |= (raw[:, 1:] != raw[:, :-1]).any(-1).any(0)
    head = torch.nonzero(first).squeeze(1)
    n_groups = head.numel()
    if more and 1 < n_groups <= max_groups:
        sizes = torch.cat([head[1:], head.new_tensor([n])]) - head
        if int(sizes[-1]) < int(sizes.max()):
            max_groups = n_groups - 1
    if n_groups > max_groups:  # end at the first token of group max_groups
        n = int(head[max_groups])
        first, head, n_groups = first[:n], head[:max_groups], max_groups
    if n_groups == n:
        return None, n
    gid = torch.cumsum(first, 0) - 1
    last = torch.cat([head[1:] - 1, head.new_tensor([n - 1])])
    slot = torch.arange(n, device=req.device) - head[gid]
    return Groups(gid, slot, n_groups, int((last - head).max()) + 1, head, last), n


def split_prefill(q: torch.Tensor, lens: torch.Tensor, raw: torch.Tensor, req: torch.Tensor, groups: Groups,
                  ragged: tuple[torch.Tensor, torch.Tensor], pool: torch.Tensor, unit: int, sm_scale: float,
                  rows: RowGather, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a chunk's grouped query tokens over a contiguous HND GQA pool on CPU.

    Token ``t`` reads, in every run its group names (``raw >= 0``, each run once), the positions
    before ``lens[t]``. Runs are gathered as contiguous pool rows (one memcpy each), in any order.

    Args:
        q: ``[n, Hq, D]`` the chunk's queries (any float dtype; read as fp32).
        lens: int64 ``[n]`` each token's kv length.
        raw: int64 ``[Hkv, G, U]`` each group's run starts (negative = not selected).
        req: int64 ``[G]`` each group's request (batch row of the ragged page table).
        groups: the chunk's groups.
        ragged: ``(paged_kv_indices, paged_kv_indptr)`` int64.
        pool: ``[blocks, 2, Hkv, P, D]`` the layer's pool, contiguous.
        unit: positions per run (divides the page ``P``).
        sm_scale: softmax scale.
        rows: the backend's buffered row gather.
        out: fp32 ``[n, Hq, D]`` zeros, contiguous: filled with the output (0 for a (token, head)
            that attends nothing).

    Returns:
        lse fp32 ``[n, Hq]`` (natural log; ``inf`` for a (token, head) that attends nothing) and
        the positions each (token, KV head) read, int64 ``[n, Hkv]``.
    """
    hkv, n_groups, _ = raw.shape
    n, hq, d = q.shape
    g, page = hq // hkv, pool.shape[3]
    gid = groups.gid
    picked = raw >= 0
    lo = lens.new_full((n_groups,), torch.iinfo(torch.int64).max).scatter_reduce_(0, gid, lens, "amin")
    hi = lens.new_zeros(n_groups).scatter_reduce_(0, gid, lens, "amax")
    full = picked & (raw + unit <= lo.view(1, -1, 1))  # [Hkv, G, U]: read whole by every member
    part = picked & ~full & (raw < hi.view(1, -1, 1))  # read in part, or by some members only
    # positions read: a picked run gives clamp(len - start, 0, unit) (a full run: unit)
    counts = torch.where(picked[:, gid], (lens.view(1, n, 1) - raw[:, gid]).clamp(0, unit), 0).sum(-1)  # [Hkv, n]
    n_full = full.sum(-1)  # [Hkv, G] runs
    # each run's K row in the pool viewed as [blocks * 2 * Hkv * P/unit, unit * D] (V: + Hkv * P/unit)
    per_page = page // unit
    start = torch.where(full | part, raw, 0)
    pages, page_start = ragged
    blk = pages[page_start[req].view(1, -1, 1) + start // page]
    heads = torch.arange(hkv, device=raw.device).view(hkv, 1, 1)
    k_row = ((blk * 2) * hkv + heads) * per_page + (start % page) // unit  # [Hkv, G, U]
    v_off = hkv * per_page
    flat = pool.view(-1, unit * d)
    qr = q.reshape(n * hkv, g * d)  # a row per (token, KV head)
    size = groups.last - groups.head + 1  # [G]
    o_full = out.view(n * hkv, g * d)
    l_full = _attend_full(qr, flat, k_row, v_off, full, n_full, size, groups, unit, sm_scale, rows, o_full)
    o_part, l_part = _attend_part(qr, flat, k_row, v_off, part, raw, lens, size, groups, unit, sm_scale, rows)
    # merge by log-sum-exp; a part a token does not read is (0, -inf)
    none = (counts - n_full[:, gid] * unit == 0).T.reshape(-1, 1)  # [n * Hkv, 1]: it reads no partial run
    if bool(none.any()):
        l_part.masked_fill_(none, -torch.inf)
        o_part.masked_fill_(none, 0.0)
    lse = torch.logaddexp(l_full, l_part)  # [n * Hkv, g]
    empty = (counts == 0).T.reshape(-1, 1)
    ref = lse.masked_fill(empty, 0.0)
    w_full, w_part = torch.exp(l_full - ref), torch.exp(l_part - ref)
    o_full.view(-1, g, d).mul_(w_full.unsqueeze(-1)).addcmul_(o_part.view(-1, g, d), w_part.unsqueeze(-1))
    return lse.masked_fill_(empty, torch.inf).view(n, hq), counts.T


def _attend_full(q: torch.Tensor, flat: torch.Tensor, k_row: torch.Tensor, v_off: int, full: torch.Tensor,
                 n_full: torch.Tensor, size: torch.Tensor, groups: Groups, unit: int, sm_scale: float,
                 rows: RowGather, out: torch.Tensor) -> torch.Tensor:
    """Every (KV head, group)'s full runs, no mask: one flash call per set of (KV head, group)
    entries with the same number of full runs and group size, the group's tokens x query heads as
    the query rows of one head.

    Args:
        q: ``[n * Hkv, g * D]`` queries, a row per (token, KV head). flat: the pool as rows of one
        run. k_row: int64 ``[Hkv, G, U]`` each run's K row in ``flat`` (V: ``+ v_off``). full:
        bool ``[Hkv, G, U]``. n_full: int64 ``[Hkv, G]`` full runs. size: int64 ``[G]`` tokens per
        group. out: fp32 ``[n * Hkv, g * D]`` zeros, filled with the output over the full runs
        (left 0 where there are none).

    Returns:
        lse fp32 ``[n * Hkv, g]`` over the full runs (``-inf`` where there are none).
    """
    hkv, d = k_row.shape[0], flat.shape[1] // unit
    g = out.shape[1] // d
    lse = out.new_full((out.shape[0], g), -torch.inf)
    key = n_full * (groups.largest + 1) + size  # [Hkv, G]: entries that batch together
    for value in torch.unique(key[n_full > 0]).tolist():
        eh, eg = torch.nonzero(key == value, as_tuple=True)  # [B]
        b, runs, m = eh.numel(), value // (groups.largest + 1), value % (groups.largest + 1)
        at = k_row[eh, eg][full[eh, eg]]  # [B * runs], entry-major
        k = rows("k", flat, at).view(b, 1, runs * unit, d)
        v = rows("v", flat, at + v_off).view(b, 1, runs * unit, d)
        at = ((groups.head[eg].view(b, 1) + torch.arange(m, device=eg.device)) * hkv + eh.view(b, 1)).flatten()
        o, l = flash_cpu(q.index_select(0, at).float().view(b, 1, m * g, d), k, v, None, sm_scale)
        out.index_copy_(0, at, o.view(b * m, g * d))
        lse.index_copy_(0, at, l.view(b * m, g))
    return lse


def _attend_part(q: torch.Tensor, flat: torch.Tensor, k_row: torch.Tensor, v_off: int, part: torch.Tensor,
                 raw: torch.Tensor, lens: torch.Tensor, size: torch.Tensor, groups: Groups, unit: int,
                 sm_scale: float, rows: RowGather) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (KV head, group)'s partial runs under a mask of the positions before each token's
    length: one flash call per group size, runs padded to the most any entry has.

    Args:
        q, flat, k_row, v_off: as :func:`_attend_full`. part: bool ``[Hkv, G, U]``. raw: int64
        ``[Hkv, G, U]`` run starts. lens: int64 ``[n]``. size: int64 ``[G]`` tokens per group.

    Returns:
        out fp32 ``[n * Hkv, g * D]`` and lse fp32 ``[n * Hkv, g]`` over the partial runs (0 and
        ``-inf`` where an entry has none; unspecified for a token that reads none of them).
    """
    hkv, d = k_row.shape[0], flat.shape[1] // unit
    g = q.shape[1] // d
    n_part = part.sum(-1)  # [Hkv, G]
    has = n_part > 0
    # every row is written when every entry has partial runs
    out = (q.new_empty if bool(has.all()) else q.new_zeros)(q.shape, dtype=torch.float32)
    lse = out.new_full((q.shape[0], g), -torch.inf)
    size = size.expand_as(n_part)
    for m in torch.unique(size[has]).tolist():
        eh, eg = torch.nonzero((size == m) & has, as_tuple=True)  # [B]
        b, runs = eh.numel(), int(n_part[eh, eg].max())
        mine = part[eh, eg]  # [B, U]
        order = torch.argsort((~mine).to(torch.int8), dim=1, stable=True)[:, :runs]  # its partial runs first
        used = mine.gather(1, order)  # [B, runs]
        at = k_row[eh, eg].gather(1, order).flatten()  # padding reads some row of the request, masked
        k = rows("k", flat, at).view(b, 1, runs * unit, d).expand(-1, g, -1, -1)
        v = rows("v", flat, at + v_off).view(b, 1, runs * unit, d).expand(-1, g, -1, -1)
        pos = raw[eh, eg].gather(1, order).unsqueeze(-1) + torch.arange(unit, device=raw.device)  # [B, runs, unit]
        pos = torch.where(used.unsqueeze(-1), pos, torch.iinfo(torch.int64).max).view(b, 1, -1)
        tok = groups.head[eg].view(b, 1) + torch.arange(m, device=eg.device)  # [B, m]
        bias = torch.where(pos < lens[tok].unsqueeze(-1), 0.0, -torch.inf)  # [B, m, runs * unit]
        at = (tok * hkv + eh.view(b, 1)).flatten()
        qb = q.index_select(0, at).float().view(b, m, g, d).transpose(1, 2)
        o, l = flash_cpu(qb, k, v, bias.unsqueeze(1).expand(-1, g, -1, -1), sm_scale)  # [B, g, m, D], [B, g, m]
        out.index_copy_(0, at, o.transpose(1, 2).reshape(b * m, g * d))
        lse.index_copy_(0, at, l.transpose(1, 2).reshape(b * m, g))
    return out, lse
