"""Skip-softmax (BLASST) on the CPU backends: the Triton kernels' tile-wise rule, tile for tile.

The Triton kernels walk each program's KV positions in tiles of ``block_n`` and skip a tile when,
for every real query row of the program, ``exp(tile_max - running_max) < factor / kv_len`` (the
first tile of a row always runs; a tile with no valid position never does). Whether a tile is
skipped depends on which rows share a program and where the tile boundaries fall, so the CPU
backends rebuild the kernels' programs exactly (:class:`SkipTiling`, read from the same launch
tables as the kernels):

* GQA generation rows, and GQA context rows with a selection: one program per (token, KV head)
  holding the whole query group (the kernels pad the group to ``block_h >= group``); the walk is
  the token's expanded selection (each segment as a set, ascending, ``-1`` padding at its tail,
  entry ``e`` of block size ``B`` covering ``[e*B, (e+1)*B)``, invalid slots masked but walked),
  or ``[0, kv_len)`` when the phase is dense.
* GQA context rows without a selection: the dense tiled prefill; one program per (query tile,
  KV head), a query tile being ``tokens_per_tile`` consecutive tokens of one request x the group,
  walked over ``[0, max kv_len of the tile)`` with each row masked to its own ``kv_len`` and its
  own ``factor / kv_len``.
* MLA rows (both phases): one program per (token, block of ``block_h`` heads), walked as GQA
  generation rows.

The counters are those of the kernels: ``walked`` = tiles each program walks, ``skipped`` = those
it skipped. Split-K is off for CPU tensors (the interpreter launch table), so the walk is one
split; CUDA tensors are refused (the kernels' split-K there is for the ``triton`` backend).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...kernels.common import launch
from ...kernels.common.checks import next_pow2
from ...kernels.paged_prefill.plan import query_tiles
from ...metadata import AttentionMetadata
from ..params import SparseRuntimeParams
from ..selection import unique_sorted_segments
from .base import AttentionGeometry

__all__ = ["SkipTiling", "skip_tiling", "phase_walk_selection", "batched_tile_walk", "walk_gather",
           "walk_dense_prefill", "skip_softmax_phase", "WalkedRows", "RequestRows"]

WalkedRows = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(token_to_req [n], pos [Hkv, n, L]) -> [Hkv, n, L, D]`` fp32 CPU: K or V rows of walked positions."""
RequestRows = Callable[[int, torch.Tensor], torch.Tensor]
"""``(request row, pos [L]) -> [L, Hkv, D]`` fp32 CPU: K or V rows of one request's positions."""


@dataclass(frozen=True)
class SkipTiling:
    """How the Triton kernels tile one phase: ``block_n`` KV positions per tile; ``heads_per_program``
    query heads of one KV head per gather program; ``tokens_per_tile`` > 0 only on the dense tiled
    prefill (query tokens per program)."""

    block_n: int
    heads_per_program: int
    tokens_per_tile: int


def skip_tiling(backend: str, geometry: AttentionGeometry, phase: str, selected: bool,
                device: torch.device) -> SkipTiling:
    """The kernels' tiling of ``phase`` (``selected``: the phase attends a selection).

    Raises ``ValueError`` for tensors whose launch table splits the walk (CUDA): use ``triton``.
    """
    arch = launch.detect_arch(device)
    group = geometry.num_q_heads // geometry.num_kv_heads
    if geometry.kind == "mla":
        cfg = launch.mla_decode_config(arch, geometry.num_q_heads)
        tiling = SkipTiling(cfg.block_n, cfg.block_h, 0)
    elif phase == "context" and not selected:
        pre = launch.prefill_config(arch, geometry.head_dim, group)
        block_m = max(pre.block_m, next_pow2(group), 16)
        return SkipTiling(pre.block_n, group, block_m // next_pow2(group))
    else:
        cfg = launch.gqa_decode_config(arch, geometry.head_dim)
        tiling = SkipTiling(cfg.block_n, group, 0)
    if cfg.max_splits != 1:
        raise ValueError(f"the {backend} backend implements skip-softmax on CPU tensors only (the kernels "
                         f"split the KV walk on {arch}); use the 'triton' backend on CUDA")
    return tiling


def phase_walk_selection(params: SparseRuntimeParams | None, phase: str, rows: slice
                         ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """``(indices, offsets, block_size)`` as the kernels walk them for query rows ``rows`` of
    ``phase``: each segment a set (ascending, ``-1`` padding at its tail), offsets re-based to
    ``rows.start``; ``(None, None, 1)`` when the phase is dense."""
    if params is None or not params.selects_positions(phase):
        return None, None, 1
    off = params.sparse_attn_offsets
    lo, hi = int(off[rows.start]), int(off[rows.stop])
    local = (off[rows.start: rows.stop + 1] - lo).to(torch.int64)
    return (unique_sorted_segments(params.sparse_attn_indices[:, lo:hi], local).to(torch.int64), local,
            params.sparse_attn_indices_block_size)


def batched_tile_walk(s: torch.Tensor, v: torch.Tensor, n_tiles: torch.Tensor, row_ok: torch.Tensor,
                      lam: torch.Tensor, block_n: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Online softmax with the skip rule over ``P`` programs at once (one split each).

    ``s [P, R, L]`` fp32 scaled logits (``-inf`` = masked), ``v [P, L, Dv]`` fp32, ``n_tiles [P]``
    tiles program ``p`` walks (its walk is ``s[p, :, :n_tiles[p] * block_n]``), ``row_ok [P, R]``
    bool real rows, ``lam [P, R]`` the rows' ``factor / kv_len``. Returns ``out [P, R, Dv]``,
    natural-log ``lse [P, R]`` (``+inf`` where nothing was attended), skipped and walked tiles.
    """
    p_, r_, length = s.shape
    m = torch.full((p_, r_), float("-inf"))
    l = torch.zeros(p_, r_)
    acc = torch.zeros(p_, r_, v.shape[-1])
    skipped = 0
    for tile in range(-(-length // block_n)):
        cols = slice(tile * block_n, min(tile * block_n + block_n, length))
        st = s[:, :, cols]
        t_max = st.amax(-1)
        active = tile < n_tiles
        keep = ((torch.exp(t_max - m.clamp(min=-3.0e38)) >= lam) & row_ok).any(-1) & active  # [P]
        skipped += int((active & ~keep).sum())
        m_new = torch.where(keep[:, None], torch.maximum(m, t_max), m)
        m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_safe)
        prob = torch.exp(st - m_safe[..., None]) * keep[:, None, None]
        l = torch.where(keep[:, None], l * alpha + prob.sum(-1), l)
        acc = torch.where(keep[:, None, None], acc * alpha[..., None] + prob @ v[:, cols], acc)
        m = m_new
    has = l > 0
    out = acc / torch.where(has, l, 1.0)[..., None]
    lse = torch.where(has, m + torch.log(torch.where(has, l, 1.0)), torch.full_like(l, float("inf")))
    return out, lse, skipped, int(n_tiles.sum())


def gather_programs(q: torch.Tensor, lens: torch.Tensor, sel: tuple[torch.Tensor | None, torch.Tensor | None, int],
                    geometry: AttentionGeometry, tiling: SkipTiling, factor: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gather kernel's programs for query tokens ``q [n, Hq, D]`` with ``lens [n]``.

    Returns walked positions ``pos [Hkv, n, L]`` (``-1`` = masked slot), tiles per (head, token)
    ``n_tiles [Hkv, n]``, and per program row the query ``[Hkv, n, B, Rb, D]`` (``B`` head blocks of
    ``Rb`` rows), ``row_ok [Hkv, n, B, Rb]``, ``lam [Hkv, n, B, Rb]`` and the query head of each row
    ``[B, Rb]`` (per KV head, ``-1`` for padding rows).
    """
    idx, off, bs = sel
    n, hq, d = q.shape
    hkv = geometry.num_kv_heads
    lens = lens.to(torch.int64).cpu()
    if idx is None:
        width = int(lens.max()) if n else 0
        pos = torch.arange(width).expand(hkv, n, width)
        walk = lens
    else:
        seg = off.diff().cpu()
        k = int(seg.max()) if n else 0
        j = torch.arange(k)
        at = (off[:-1].cpu().unsqueeze(1) + j).clamp(max=max(idx.shape[1] - 1, 0))
        units = idx.cpu()[:, at] if k else torch.zeros(hkv, n, 0, dtype=torch.int64)
        units = torch.where(j < seg.unsqueeze(1), units, -1)
        pos = (units.unsqueeze(-1) * bs + torch.arange(bs)).flatten(2)
        pos = torch.where(units.repeat_interleave(bs, dim=2) >= 0, pos, -1)
        walk = seg * bs
    pos = torch.where(pos < lens.view(1, n, 1), pos, -1)
    n_tiles = (-(-walk // tiling.block_n)).expand(hkv, n)
    group = hq // hkv
    rb = min(tiling.heads_per_program, group)
    blocks = -(-group // rb)
    head = torch.arange(blocks * rb).view(blocks, rb)
    head = torch.where(head < group, head, -1)
    qg = q.float().cpu().view(n, hkv, group, d).permute(1, 0, 2, 3)  # [Hkv, n, g, D]
    qp = qg[:, :, head.clamp(min=0)] * (head >= 0).view(1, 1, blocks, rb, 1)
    row_ok = (head >= 0).expand(hkv, n, blocks, rb)
    lam = (factor / lens.clamp(min=1).float()).view(1, n, 1, 1).expand(hkv, n, blocks, rb)
    return pos, n_tiles, qp, row_ok, lam, head


def walk_gather(q: torch.Tensor, k: WalkedRows, v: WalkedRows, token_to_req: torch.Tensor, lens: torch.Tensor,
                sel: tuple[torch.Tensor | None, torch.Tensor | None, int], geometry: AttentionGeometry,
                tiling: SkipTiling, factor: float) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Gather-kernel attention of ``q [n, Hq, D]`` whose walked K/V rows the caller gathered:
    ``k``/``v`` are callables ``(token_to_req [n], pos [Hkv, n, L]) -> [Hkv, n, L, D]`` fp32
    (``pos >= 0``, request-local positions of each token's request). Returns
    ``out [n, Hq, Dv]``, ``lse [n, Hq]`` and the tile counters."""
    pos, n_tiles, qp, row_ok, lam, head = gather_programs(q, lens, sel, geometry, tiling, factor)
    hkv, n, length = pos.shape
    blocks, rb = head.shape
    valid = pos >= 0
    kk, vv = k(token_to_req, pos.clamp(min=0)), v(token_to_req, pos.clamp(min=0))  # [Hkv, n, L, D]
    s = torch.einsum("hnbrd,hnld->hnbrl", qp, kk) * geometry.sm_scale
    s = s.masked_fill(~valid[:, :, None, None, :], float("-inf"))
    out, lse, skipped, walked = batched_tile_walk(
        s.reshape(-1, rb, length), vv.unsqueeze(2).expand(hkv, n, blocks, length, vv.shape[-1]).reshape(
            -1, length, vv.shape[-1]), n_tiles.unsqueeze(2).expand(hkv, n, blocks).reshape(-1),
        row_ok.reshape(-1, rb), lam.reshape(-1, rb), tiling.block_n)
    group = geometry.num_q_heads // hkv
    o = torch.zeros(hkv, n, group, vv.shape[-1])
    ls = torch.full((hkv, n, group), float("inf"))
    real = head.flatten() >= 0
    o[:, :, head.flatten()[real]] = out.view(hkv, n, blocks * rb, -1)[:, :, real]
    ls[:, :, head.flatten()[real]] = lse.view(hkv, n, blocks * rb)[:, :, real]
    return o.permute(1, 0, 2, 3).reshape(n, -1, vv.shape[-1]), ls.permute(1, 0, 2).reshape(n, -1), skipped, walked


def walk_dense_prefill(q: torch.Tensor, k: RequestRows, v: RequestRows, lens: torch.Tensor,
                       token_to_req: torch.Tensor, geometry: AttentionGeometry, tiling: SkipTiling,
                       factor: float) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Dense tiled prefill programs of GQA context tokens ``q [n, Hq, D]`` (``lens [n]`` causal
    limits, ``token_to_req [n]``). ``k``/``v``: callables ``(request row, positions [L]) ->
    [L, Hkv, D]`` fp32. Returns ``out``, ``lse`` and the tile counters."""
    n, hq, d = q.shape
    hkv = geometry.num_kv_heads
    group = hq // hkv
    lens = lens.to(torch.int64).cpu()
    out = torch.zeros(n, hq, geometry.value_dim)
    lse = torch.full((n, hq), float("inf"))
    skipped = walked = 0
    starts, counts = (x.tolist() for x in query_tiles(token_to_req.cpu(), tiling.tokens_per_tile))
    for t0, cnt in zip(starts, counts):
        toks = torch.arange(t0, t0 + cnt)
        max_len = int(lens[toks].max())
        pos = torch.arange(max_len)
        req = int(token_to_req[t0])
        kk, vv = k(req, pos).permute(1, 0, 2), v(req, pos).permute(1, 0, 2)  # [Hkv, L, D]
        row_len = lens[toks].repeat_interleave(group)  # [R] token-major
        qf = q[toks].float().cpu().view(cnt, hkv, group, d).permute(1, 0, 2, 3).reshape(hkv, cnt * group, d)
        s = (qf @ kk.transpose(1, 2)) * geometry.sm_scale
        s = s.masked_fill(~(pos[None, :] < row_len[:, None]).unsqueeze(0), float("-inf"))
        lam = (factor / row_len.clamp(min=1).float()).expand(hkv, -1)
        o, ls, sk, wk = batched_tile_walk(s, vv, torch.full((hkv,), -(-max_len // tiling.block_n)),
                                          torch.ones(hkv, cnt * group, dtype=torch.bool), lam, tiling.block_n)
        out[toks] = o.view(hkv, cnt, group, -1).permute(1, 0, 2, 3).reshape(cnt, hq, -1)
        lse[toks] = ls.view(hkv, cnt, group).permute(1, 0, 2).reshape(cnt, hq)
        skipped, walked = skipped + sk, walked + wk
    return out, lse, skipped, walked


def skip_softmax_phase(backend: str, q: torch.Tensor, metadata: AttentionMetadata, geometry: AttentionGeometry,
                       params: SparseRuntimeParams, phase: str, rows: slice, k: WalkedRows, v: WalkedRows,
                       k_req: RequestRows, v_req: RequestRows, max_gather_bytes: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, int, int, str]:
    """Skip-softmax attention of the rows ``rows`` of ``phase``; ``k``/``v`` gather walked rows
    (see :func:`walk_gather`), ``k_req``/``v_req`` a request's positions (see
    :func:`walk_dense_prefill`). Gather programs are independent per token, so with
    ``max_gather_bytes`` the rows run in chunks whose gathered K/V stay under it (same result).
    Returns ``out [n, Hq, Dv]``, ``lse [n, Hq]``, skipped and walked tiles, and the path."""
    factor = params.threshold_scale_factor(phase)
    selected = params.selects_positions(phase)
    tiling = skip_tiling(backend, geometry, phase, selected, q.device)
    lens = metadata.token_kv_lens
    if tiling.tokens_per_tile:
        o, l, sk, wk = walk_dense_prefill(q[rows], k_req, v_req, lens[rows], metadata.token_to_req[rows], geometry,
                                          tiling, factor)
        return o, l, sk, wk, "skip_dense_tiled"
    chunk = rows.stop - rows.start
    if max_gather_bytes is not None and chunk:
        if selected:
            width = int(params.row_slice(rows).sparse_attn_offsets.diff().max())
            width *= params.sparse_attn_indices_block_size
        else:
            width = int(lens[rows].max())
        per_token = max(width, 1) * (geometry.num_kv_heads * (q.shape[-1] + geometry.value_dim)
                                     + geometry.num_q_heads) * 4
        chunk = max(1, max_gather_bytes // per_token)
    outs, lses, skipped, walked = [], [], 0, 0
    for t0 in range(rows.start, rows.stop, max(chunk, 1)):
        sub = slice(t0, min(t0 + chunk, rows.stop))
        o, l, sk, wk = walk_gather(q[sub], k, v, metadata.token_to_req[sub], lens[sub],
                                   phase_walk_selection(params, phase, sub), geometry, tiling, factor)
        outs.append(o)
        lses.append(l)
        skipped, walked = skipped + sk, walked + wk
    if not outs:
        return (torch.zeros(0, geometry.num_q_heads, geometry.value_dim), torch.zeros(0, geometry.num_q_heads),
                0, 0, "skip_gather")
    return torch.cat(outs), torch.cat(lses), skipped, walked, "skip_gather"
