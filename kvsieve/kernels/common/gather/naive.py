"""Plain-PyTorch reference of the shared gather attention (:mod:`.triton`): the same expanded
position space walked in the same ``block_n`` tiles and ``num_splits`` splits as the kernel (both
read them from ``launch.py`` through the op's plan), so skip-softmax decisions, tile counts and
outputs compare one to one. The splits are merged by the one merge-states reference
(:func:`kvsieve.kernels.common.merge_states.naive.merge_states`).
"""
from __future__ import annotations

import math

import torch

from ..merge_states.naive import merge_states
from .plan import GatherPlan

__all__ = ["expand_positions", "gather_rows", "walk_tiles", "gather_attention_reference"]


def expand_positions(indices_row: torch.Tensor | None, start: int, end: int, kv_len: int,
                     block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Walked positions ``[L]`` int64 and their validity ``[L]`` bool for one (token, head)."""
    if indices_row is None:
        pos = torch.arange(kv_len, device="cpu")
        return pos, torch.ones_like(pos, dtype=torch.bool)
    sel = indices_row[start:end].long().cpu()
    j = torch.arange(sel.numel() * block_size)
    ent = sel[j // block_size]
    pos = ent * block_size + j % block_size
    return pos, (ent >= 0) & (pos < kv_len)


def gather_rows(cache: torch.Tensor, bt_row: torch.Tensor, head: int, pos: torch.Tensor,
                valid: torch.Tensor) -> torch.Tensor:
    """Rows ``cache[page(pos), head, pos % page_size]`` as fp32 ``[L, dim]``; invalid rows 0."""
    page_size = cache.shape[2]
    safe = torch.where(valid, pos, torch.zeros_like(pos))
    page = bt_row.long().cpu()[safe // page_size]
    rows = cache[page.to(cache.device), head, (safe % page_size).to(cache.device)].float().cpu()
    return rows * valid[:, None]


def walk_tiles(s: torch.Tensor, v: torch.Tensor, block_n: int, num_splits: int,
               lam: float | torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Online softmax over ``s [R, L]`` (scaled logits, -inf = masked) and ``v [L, dv]``.

    Walks ``ceil(L / block_n)`` tiles split into ``num_splits`` contiguous chunks, applies the
    skip-softmax rule when ``lam`` (scalar or per row ``[R]``) is not None, merges the splits by LSE. Returns
    ``(out [R, dv], lse [R], skipped_tiles, walked_tiles)``.
    """
    r, length = s.shape
    n_tiles = -(-length // block_n)
    per = -(-n_tiles // num_splits)
    outs, lses = [], []
    skipped = walked = 0
    for sp in range(num_splits):
        lo, hi = sp * per, min(sp * per + per, n_tiles)
        m = torch.full((r,), float("-inf"))
        l = torch.zeros(r)
        acc = torch.zeros(r, v.shape[1])
        walked += max(hi - lo, 0)
        for tile in range(lo, hi):
            cols = slice(tile * block_n, min(tile * block_n + block_n, length))
            st = s[:, cols]
            t_max = st.amax(1)
            if lam is not None and not bool((torch.exp(t_max - m.clamp(min=-3.0e38)) >= lam).any()):
                skipped += 1
                continue
            m_new = torch.maximum(m, t_max)
            m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - m_safe)
            p = torch.exp(st - m_safe[:, None])
            l = l * alpha + p.sum(1)
            acc = acc * alpha[:, None] + p @ v[cols]
            m = m_new
        has = l > 0
        outs.append(acc / torch.where(has, l, 1.0)[:, None])
        lses.append(torch.where(has, m + torch.log(torch.where(has, l, 1.0)),
                                torch.full_like(l, float("-inf"))))
    out, lse = merge_states(torch.stack(outs, 1).unsqueeze(0), torch.stack(lses, 1).unsqueeze(0))
    return out[0], lse[0], skipped, walked


def gather_attention_reference(q: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor,
                               block_table: torch.Tensor, token_to_req: torch.Tensor,
                               kv_lens: torch.Tensor, indices: torch.Tensor | None,
                               offsets: torch.Tensor | None, block_size: int, plan: GatherPlan,
                               stats: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``launch_gather_attention``: per (token, KV head, head block) tile walk."""
    num_tokens, num_q_heads, _ = q.shape
    out = torch.zeros(num_tokens, num_q_heads, plan.dv)
    lse = torch.full((num_tokens, num_q_heads), math.inf)
    skipped = walked = 0
    offs = offsets.long().cpu().tolist() if offsets is not None else None
    lens = kv_lens.long().cpu().tolist()
    reqs = token_to_req.long().cpu().tolist()
    for t in range(num_tokens):
        bt_row = block_table[reqs[t]]
        lam = plan.threshold_scale_factor / lens[t] if plan.threshold_scale_factor > 0 else None
        for h in range(k4.shape[1]):
            row = indices[h] if indices is not None else None
            start, end = (offs[t], offs[t + 1]) if offs is not None else (0, 0)
            pos, valid = expand_positions(row, start, end, lens[t], block_size)
            k = gather_rows(k4, bt_row, h, pos, valid)
            v = gather_rows(v4, bt_row, h, pos, valid)[:, :plan.dv]
            for h0 in range(0, plan.group, plan.block_h):
                heads = range(h * plan.group + h0, h * plan.group + min(h0 + plan.block_h,
                                                                        plan.group))
                qf = q[t, list(heads)].float().cpu()
                s = (qf @ k.T) * plan.sm_scale
                s = torch.where(valid[None, :], s, torch.full_like(s, float("-inf")))
                o, ls, sk, wk = walk_tiles(s, v, plan.block_n, plan.num_splits, lam)
                out[t, list(heads)] = o
                lse[t, list(heads)] = ls
                skipped, walked = skipped + sk, walked + wk
    if stats is not None:
        stats += torch.tensor([skipped, walked], dtype=stats.dtype, device=stats.device)
    return out.to(q.dtype).to(q.device), lse.to(q.device)
