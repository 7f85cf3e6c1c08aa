"""The CPU fast path: batched gather of the selected KV through the block table, then one fused
masked-softmax attention per chunk of query tokens — no per-request Python loop.

For every (query token, KV head) the backend builds the request-local positions it reads
(``[Hkv, T, K]``, ``-1`` = nothing): the selection expanded from blocks to tokens, or
``[0, kv_len)`` for dense layers. Positions map to ``(block, offset)`` through the block table, K
and V rows are gathered in one advanced-indexing op, and attention runs in fp32. Query tokens
are processed in chunks sized so the gathered tile stays under ``max_gather_bytes``.
"""
from __future__ import annotations

import math

import torch

from ...metadata import AttentionMetadata
from ..params import SparseRuntimeParams
from .base import AttentionBackend, AttentionGeometry

__all__ = ["TorchBackend", "selected_positions"]


def selected_positions(params: SparseRuntimeParams | None, token_kv_lens: torch.Tensor, num_kv_heads: int,
                       rows: slice) -> torch.Tensor:
    """int64 ``[Hkv, n, K]`` request-local positions read by query tokens ``rows`` (``-1`` = none).

    Dense: ``K = max kv_len`` of the rows. Token selection: ``K`` = the rows' slice length. Block
    selection of size ``B``: every block expanded to its ``B`` positions. Entries past each
    token's ``kv_len`` become ``-1`` (never read).
    """
    lens = token_kv_lens[rows].to(torch.int64)
    n = lens.numel()
    if params is None or params.sparse_attn_indices is None:
        width = int(lens.max()) if n else 0
        pos = torch.arange(width, device=lens.device).expand(num_kv_heads, n, width)
    else:
        sel, bs = _selection(params, num_kv_heads, rows, n)
        if bs > 1:
            sel = (sel.unsqueeze(-1) * bs + torch.arange(bs, device=sel.device)).masked_fill(sel.unsqueeze(-1) < 0, -1)
            sel = sel.flatten(2)
        pos = sel
    return torch.where((pos >= 0) & (pos < lens.view(1, n, 1)), pos, -1)


def _selection(params: SparseRuntimeParams, num_kv_heads: int, rows: slice, n: int) -> tuple[torch.Tensor, int]:
    """int64 ``[Hkv, n, k]`` selected units of query tokens ``rows`` and the unit (block) size."""
    off = params.sparse_attn_offsets.to(torch.int64)
    start, stop = int(off[rows.start]), int(off[rows.stop])
    k = (stop - start) // n if n else 0
    if n and off[rows.start: rows.stop + 1].diff().ne(k).any():
        raise ValueError("the torch backend needs equal selection lengths for the query tokens of a step "
                         "(as from SparseRuntimeParams.from_topk)")
    sel = params.sparse_attn_indices[:, start:stop].to(torch.int64).view(num_kv_heads, n, k)
    return sel, params.sparse_attn_indices_block_size


def _unit_starts(params: SparseRuntimeParams | None, lens: torch.Tensor, num_kv_heads: int, rows: slice,
                 unit: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs of ``unit`` consecutive positions read by query tokens ``rows``: their first positions
    ``[Hkv, n, U]`` int64 (0 where unused), whether each is used at all (``[Hkv, n, U]`` bool), and
    the first positions before masking (what the selection names, equal for tokens sharing it).

    ``unit`` divides the selection's block size (dense: any unit); the runs, expanded in order,
    are exactly the positions of :func:`selected_positions`, padded to whole units.
    """
    lens = lens[rows].to(torch.int64)
    n = lens.numel()
    if params is None or params.sparse_attn_indices is None:
        count = -(-int(lens.max()) // unit) if n else 0
        starts = (torch.arange(count, device=lens.device) * unit).expand(num_kv_heads, n, count)
        ok = starts < lens.view(1, n, 1)
    else:
        sel, bs = _selection(params, num_kv_heads, rows, n)
        per = bs // unit
        starts = sel.unsqueeze(-1) * bs + torch.arange(per, device=sel.device) * unit
        ok = ((sel >= 0).unsqueeze(-1) & (starts < lens.view(1, n, 1, 1))).flatten(2)
        starts = starts.flatten(2)
    return torch.where(ok, starts, 0), ok, starts


class TorchBackend(AttentionBackend):
    """Batched PyTorch attention over exactly the selected set; the default backend on CPU."""

    name = "torch"
    devices = frozenset({"cpu", "cuda"})

    def __init__(self, max_gather_bytes: int = 256 << 20) -> None:
        self.max_gather_bytes = max_gather_bytes
        # grow-only gather buffers reused across calls: a fresh multi-MiB tensor per call is a fresh
        # mmap, and its page faults cost several times the copy itself (bounded by max_gather_bytes)
        self._scratch: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        key = (name, dtype, device)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._scratch[key] = buf
        return buf[:numel].view(shape)

    def _rows(self, name: str, flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``flat.index_select(0, index)`` into a reused buffer, then fp32 (a no-op for fp32 pools)."""
        out = self._buffer(name, (index.numel(), flat.shape[1]), flat.dtype, flat.device)
        torch.index_select(flat, 0, index, out=out)
        if flat.dtype == torch.float32:
            return out
        return self._buffer(name + "_f32", tuple(out.shape), torch.float32, flat.device).copy_(out)

    def forward(self, q: torch.Tensor, metadata: AttentionMetadata, layer_idx: int, geometry: AttentionGeometry,
                params: SparseRuntimeParams | None) -> tuple[torch.Tensor, torch.Tensor]:
        if params is not None and (params.threshold_scale_factor > 0 or params.decode_threshold > 0):
            raise ValueError("the torch backend does not implement skip-softmax "
                             "(threshold_scale_factor > 0); use the 'triton' backend")
        mgr = metadata.kv_cache_manager
        n_tok, hq = q.shape[0], q.shape[1]
        out = torch.zeros(n_tok, hq, geometry.value_dim, dtype=torch.float32, device=q.device)
        lse = torch.full((n_tok, hq), torch.inf, dtype=torch.float32, device=q.device)
        if n_tok == 0:
            return out.to(q.dtype), lse
        if geometry.kind == "mla":
            lat = mgr.latent_cache(layer_idx).unsqueeze(1)  # [blocks, 1, P, R+rope]
            k_cache, v_cache = lat, lat[..., : geometry.kv_lora_rank]
        else:
            k_cache, v_cache = mgr.k_cache(layer_idx), mgr.v_cache(layer_idx)
        table = metadata.block_table.to(torch.int64)
        tok_req = metadata.token_to_req.to(torch.int64)
        lens = metadata.token_kv_lens
        hkv, page = geometry.num_kv_heads, mgr.tokens_per_block
        width = self._width(params, lens)
        row_bytes = max(width, 1) * hkv * (k_cache.shape[-1] + v_cache.shape[-1]) * 4 * 3
        chunk = max(1, self.max_gather_bytes // row_bytes)
        heads = torch.arange(hkv, device=q.device).view(hkv, 1, 1)
        pool = mgr.pools[layer_idx]
        bs = 1 if params is None or params.sparse_attn_indices is None else params.sparse_attn_indices_block_size
        rowwise = pool.is_contiguous() and (geometry.kind == "mla" or mgr.spec.layout == "HND")
        unit = page if bs == 1 and (params is None or params.sparse_attn_indices is None) else math.gcd(bs, page)
        for t0 in range(0, n_tok, chunk):
            rows = slice(t0, min(t0 + chunk, n_tok))
            groups = None
            if rowwise:
                k, v, valid, groups = self._gather_runs(pool, geometry, params, table, tok_req, lens, rows, unit, page)
            else:
                pos = selected_positions(params, lens, hkv, rows)  # [Hkv, n, K]
                valid = pos >= 0
                p = pos.clamp(min=0)
                blk = table[tok_req[rows]].view(1, -1, table.shape[1]).expand(hkv, -1, -1).gather(2, p // page)
                k = k_cache[blk, heads, p % page].float()  # [Hkv, n, K, D]
                v = v_cache[blk, heads, p % page].float()
            n = valid.shape[1]
            g = hq // hkv
            qs = q[rows].float().view(n, hkv, g, -1).permute(1, 0, 2, 3) * geometry.sm_scale  # [Hkv, n, g, D]
            if groups is None:
                # K as the left operand streams the gathered rows once (q @ K^T would copy K transposed)
                s = torch.matmul(k, qs.transpose(-1, -2)).transpose(-1, -2)  # [Hkv, n, g, K]
            else:  # tokens of a group share one gathered K/V: [Hkv, G, M, g, D] padded query tiles
                gid, slot, n_groups, m = groups
                qt = qs.new_zeros(hkv, n_groups, m, g, qs.shape[-1])
                qt[:, gid, slot] = qs
                s = torch.matmul(k, qt.view(hkv, n_groups, m * g, -1).transpose(-1, -2)).transpose(-1, -2)
                s = s.reshape(hkv, n_groups, m, g, -1)[:, gid, slot]  # [Hkv, n, g, K]
            s = s.masked_fill(~valid.unsqueeze(2), float("-inf"))
            row_lse = torch.logsumexp(s, dim=-1)
            empty = torch.isneginf(row_lse)
            prob = torch.exp(s - torch.where(empty, 0.0, row_lse).unsqueeze(-1))
            if groups is None:
                o = torch.matmul(prob, v)  # [Hkv, n, g, Dv]
            else:
                pt = prob.new_zeros(hkv, n_groups, m, g, prob.shape[-1])
                pt[:, gid, slot] = prob
                o = torch.matmul(pt.view(hkv, n_groups, m * g, -1), v).view(hkv, n_groups, m, g, -1)[:, gid, slot]
            out[rows] = o.permute(1, 0, 2, 3).reshape(n, hq, -1)
            lse[rows] = torch.where(empty, torch.inf, row_lse).permute(1, 0, 2).reshape(n, hq)
        return out.to(q.dtype), lse

    def _gather_runs(self, pool: torch.Tensor, geometry: AttentionGeometry, params: SparseRuntimeParams | None,
                     table: torch.Tensor, tok_req: torch.Tensor, lens: torch.Tensor, rows: slice, unit: int,
                     page: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple | None]:
        """Gather whole runs of ``unit`` positions as contiguous rows of the pool (``index_select``,
        one memcpy per run) instead of one row per token. GQA HND pool ``[blocks, 2, Hkv, P, D]``
        or MLA latent ``[blocks, P, R+rope]``, contiguous.

        Consecutive query tokens of one request that name the same runs (a prefill's dense rows, a
        query block of a block-sparse prefill) form a group and share one gather, made for the
        group's last token (the longest causal range, so a superset of the others' valid runs).
        Returns K ``[Hkv, G, K, D]``, V ``[Hkv, G, K, Dv]`` (fp32; ``G`` = groups, or tokens when
        no two share), the per-token valid mask ``[Hkv, n, K]`` and ``(group of each token, slot in
        its group, G, largest group)`` or ``None`` when every token is its own group."""
        hkv = geometry.num_kv_heads
        starts, ok, raw = _unit_starts(params, lens, hkv, rows, unit)  # [Hkv, n, U]
        n, u = starts.shape[1], starts.shape[2]
        req = tok_req[rows]
        pos = (starts.unsqueeze(-1) + torch.arange(unit, device=starts.device)).flatten(2)  # [Hkv, n, U*unit]
        valid = ok.repeat_interleave(unit, dim=2) & (pos < lens[rows].to(torch.int64).view(1, n, 1))
        groups = None
        if n > 1:
            first = torch.ones(n, dtype=torch.bool, device=req.device)
            first[1:] = req[1:] != req[:-1]
            if u:
                first[1:] |= (raw[:, 1:] != raw[:, :-1]).any(-1).any(0)
            n_groups = int(first.sum())
            if n_groups < n:
                gid = torch.cumsum(first, 0) - 1
                heads = torch.nonzero(first).squeeze(1)
                last = torch.cat([heads[1:] - 1, heads.new_tensor([n - 1])])
                slot = torch.arange(n, device=req.device) - heads[gid]
                groups = (gid, slot, n_groups, int((last - heads).max()) + 1)
                starts, ok, req = starts[:, last], ok[:, last], req[last]
        blk = table[req].unsqueeze(0).expand(hkv, -1, -1).gather(2, starts // page)  # [Hkv, G, U]
        sub = (starts % page) // unit
        per_page = page // unit
        rows_g = blk.shape[1]
        if geometry.kind == "mla":
            width = pool.shape[-1]
            flat = pool.view(-1, unit * width)
            lat = self._rows("k", flat, (blk * per_page + sub).flatten()).view(1, rows_g, u * unit, width)
            return lat, lat[..., : geometry.kv_lora_rank], valid, groups
        d = pool.shape[-1]
        flat = pool.view(-1, unit * d)
        h = torch.arange(hkv, device=blk.device).view(hkv, 1, 1)
        k_rows = ((blk * 2) * hkv + h) * per_page + sub
        k = self._rows("k", flat, k_rows.flatten()).view(hkv, rows_g, u * unit, d)
        v = self._rows("v", flat, (k_rows + hkv * per_page).flatten()).view(hkv, rows_g, u * unit, d)
        return k, v, valid, groups

    @staticmethod
    def _width(params: SparseRuntimeParams | None, lens: torch.Tensor) -> int:
        if params is None or params.sparse_attn_indices is None:
            return int(lens.max())
        total = params.sparse_attn_indices.shape[1]
        return total // max(lens.numel(), 1) * params.sparse_attn_indices_block_size
