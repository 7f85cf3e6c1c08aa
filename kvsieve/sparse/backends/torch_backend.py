"""The CPU fast path: batched gather of the selected KV through FlashInfer's ragged page table,
then one fused masked-softmax attention per chunk of query tokens — no per-request Python loop.

For every (query token, KV head) the backend builds the request-local positions it reads
(``[Hkv, T, K]``, ``-1`` = nothing): the selection expanded from blocks to tokens, or
``[0, kv_len)`` for rows of a dense phase. Positions map to ``(block, offset)`` through the
``ragged_page_table`` translation (page ``j`` of batch row ``b`` is
``paged_kv_indices[paged_kv_indptr[b] + j]``, ``batch_indices`` gives each token's row), K and V
rows are gathered in one advanced-indexing op, and attention runs in fp32. Query tokens are
processed per phase, in chunks sized so the gathered tile stays under ``max_gather_bytes``.
Tokens that share one gather (a prefill's dense rows, a block-sparse prefill's query blocks)
form groups; on a GQA HND cache on CPU each group's attention is split into the runs every
member reads whole and the few it reads in part (:mod:`._torch_prefill`, no per-position tensors),
both through PyTorch's fused CPU flash-attention kernel; a chunk ends early when its gathers would
pass ``max_gather_bytes``. A phase or chunk of a single token on CPU (the decode step of one
request) takes a short path: its runs computed on the host, then the native kernel
(:mod:`kvsieve.kernels.cpu.sparse_decode`) reads them in place — or, where its library is
unavailable, one K+V gather and the same flash kernel.

Selections are read as sets: rows may have different lengths (``-1`` padded here), and an index
listed twice in a row (possible only with validation off) is attended once, as in the Vanilla
golden and the Triton kernels.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ...kernels.cpu import NativeUnavailable
from ...kernels.cpu.sparse_decode import sparse_decode_native, supports_native
from ...metadata import AttentionMetadata
from ..params import SparseRuntimeParams
from ._torch_prefill import Groups, flash_cpu, group_tokens, split_prefill
from ._torch_selection import selected_positions, unit_starts
from .base import AttentionBackend, AttentionGeometry, AttentionResult, BackendCapabilities, register_backend
from .skip_tiling import RequestRows, WalkedRows, skip_softmax_phase

__all__ = ["TorchBackend"]

# A chunk's rows are padded to its longest row: in a causal prefill chunks of 512 rows read at
# most 511 padded positions per row (whole-prompt chunks computed the full square, 2x the work).
MAX_CHUNK_ROWS = 512


@register_backend
class TorchBackend(AttentionBackend):
    """Batched PyTorch attention over exactly the selected set; the default backend on CPU."""

    name = "torch"
    required_translations = ("ragged_page_table",)
    # skip-softmax rebuilds the Triton kernels' CPU launch table (skip_tiling): CPU only
    capabilities = BackendCapabilities(skip_softmax_devices=frozenset({"cpu"}))

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
                params: SparseRuntimeParams | None) -> AttentionResult:
        metadata.require(f"backend {self.name!r}", self.required_translations)
        n_tok, hq = q.shape[0], q.shape[1]
        phases = metadata.phases()
        if n_tok == 1 and self._token_path(q, metadata, layer_idx, geometry) and not (
                params is not None and params.threshold_scale_factor(phases[0]) > 0):
            # one query token (the decode step of one request): its result is the step's
            sel = params if params is not None and params.selects_positions(phases[0]) else None
            o, row_lse, counts, path = self._attend_token(q, metadata, 0, metadata.kv_cache_manager.pools[layer_idx],
                                                          geometry, sel)
            return AttentionResult(o.view(1, hq, -1).to(q.dtype), row_lse.view(1, hq), counts.view(1, -1),
                                   {phases[0]: ("dense_" if sel is None else "sparse_") + path})
        out = torch.zeros(n_tok, hq, geometry.value_dim, dtype=torch.float32, device=q.device)
        lse = torch.full((n_tok, hq), torch.inf, dtype=torch.float32, device=q.device)
        # what the gather read, counted from its valid masks (exact tokens, as the base class counts)
        attended = torch.zeros(n_tok, geometry.num_kv_heads, dtype=torch.int64, device=q.device)
        paths = {}
        skipped = walked = 0
        for phase in phases:
            rows = metadata.phase_rows(phase)
            if params is not None and params.threshold_scale_factor(phase) > 0:
                o, l, sk, wk, paths[phase] = self._skip_softmax(q, metadata, layer_idx, geometry, params, phase, rows)
                out[rows], lse[rows] = o.to(q.device), l.to(q.device)
                skipped, walked = skipped + sk, walked + wk
                attended[rows] = self.effective_attended_tokens(params, metadata, geometry)[rows].to(q.device)
                continue
            sel = params if params is not None and params.selects_positions(phase) else None
            paths[phase] = self._attend(q, metadata, layer_idx, geometry, sel, rows, out, lse, attended)
        return AttentionResult(out.to(q.dtype), lse, attended.cpu(), paths, skipped, walked)

    @staticmethod
    def _token_path(q: torch.Tensor, metadata: AttentionMetadata, layer_idx: int, geometry: AttentionGeometry) -> bool:
        """Whether a single query row takes :meth:`_attend_token`: a contiguous HND GQA pool on CPU."""
        mgr = metadata.kv_cache_manager
        return (geometry.kind == "gqa" and q.device.type == "cpu" and mgr.spec.layout == "HND"
                and mgr.pools[layer_idx].is_contiguous())

    def _skip_softmax(self, q: torch.Tensor, metadata: AttentionMetadata, layer_idx: int, geometry: AttentionGeometry,
                      params: SparseRuntimeParams, phase: str, rows: slice
                      ) -> tuple[torch.Tensor, torch.Tensor, int, int, str]:
        """Skip-softmax rows of ``phase``: the Triton kernels' tile walk (:mod:`.skip_softmax`) over K/V
        gathered through the ragged page table."""
        mgr = metadata.kv_cache_manager
        if geometry.kind == "mla":
            lat = mgr.latent_cache(layer_idx).unsqueeze(1)
            k_cache, v_cache = lat, lat[..., : geometry.kv_lora_rank]
        else:
            k_cache, v_cache = mgr.k_cache(layer_idx), mgr.v_cache(layer_idx)
        rpt = metadata.ragged_page_table
        pages, page_start = rpt.paged_kv_indices.to(torch.int64), rpt.paged_kv_indptr.to(torch.int64)
        page = mgr.tokens_per_block
        heads = torch.arange(geometry.num_kv_heads, device=q.device).view(-1, 1, 1)

        def walked_rows(cache: torch.Tensor) -> WalkedRows:
            def read(tok_req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
                tok_req, pos = tok_req.to(device=q.device, dtype=torch.int64), pos.to(q.device)
                blk = pages[page_start[tok_req].view(1, -1, 1) + pos // page]
                return cache[blk, heads, pos % page].float().cpu()
            return read

        def request_rows(cache: torch.Tensor) -> RequestRows:
            def read(req: int, pos: torch.Tensor) -> torch.Tensor:
                pos = pos.to(q.device)
                return cache[pages[page_start[req] + pos // page], :, pos % page].float().cpu()
            return read

        return skip_softmax_phase(self.name, q, metadata, geometry, params, phase, rows, walked_rows(k_cache),
                                  walked_rows(v_cache), request_rows(k_cache), request_rows(v_cache),
                                  self.max_gather_bytes)

    def _attend(self, q: torch.Tensor, metadata: AttentionMetadata, layer_idx: int, geometry: AttentionGeometry,
                params: SparseRuntimeParams | None, phase_rows: slice, out: torch.Tensor, lse: torch.Tensor,
                attended: torch.Tensor) -> str:
        """Attention of query rows ``phase_rows`` (one phase) into ``out``/``lse`` and the positions each
        (row, KV head) read into ``attended [T, Hkv]``; returns the path."""
        mgr = metadata.kv_cache_manager
        hq = q.shape[1]
        pool = mgr.pools[layer_idx]
        rowwise = pool.is_contiguous() and (geometry.kind == "mla" or mgr.spec.layout == "HND")
        rpt = metadata.ragged_page_table
        one_row = self._token_path(q, metadata, layer_idx, geometry)
        if one_row and phase_rows.stop - phase_rows.start == 1:  # a phase of one token: none of the set-up below
            t = phase_rows.start
            out[t], lse[t], attended[t], path = self._attend_token(q, metadata, t, pool, geometry, params)
            return ("dense_" if params is None else "sparse_") + path
        if geometry.kind == "mla":
            lat = mgr.latent_cache(layer_idx).unsqueeze(1)  # [blocks, 1, P, R+rope]
            k_cache, v_cache = lat, lat[..., : geometry.kv_lora_rank]
        else:
            k_cache, v_cache = mgr.k_cache(layer_idx), mgr.v_cache(layer_idx)
        pages, page_start = rpt.paged_kv_indices.to(torch.int64), rpt.paged_kv_indptr.to(torch.int64)
        tok_req = rpt.batch_indices.to(torch.int64)
        lens = metadata.token_kv_lens
        hkv, page = geometry.num_kv_heads, mgr.tokens_per_block
        width = self._width(params, lens, phase_rows)
        # bytes per query token: its gathered K/V (with the score tensors, x3) and, shared or not,
        # its positions, masks and scores bias (~16 B per position and KV head)
        gather_bytes = max(width, 1) * hkv * (k_cache.shape[-1] + v_cache.shape[-1]) * 4 * 3
        token_bytes = max(width, 1) * hkv * 16
        heads = torch.arange(hkv, device=q.device).view(hkv, 1, 1)
        bs = 1 if params is None else params.sparse_attn_indices_block_size
        unit = page if params is None else math.gcd(bs, page)
        share = 1.0  # gathers per token in the last chunk: tokens of one group share a gather
        t0 = phase_rows.start
        while t0 < phase_rows.stop:
            chunk = max(1, min(MAX_CHUNK_ROWS, int(self.max_gather_bytes // (gather_bytes * share + token_bytes))))
            rows = slice(t0, min(t0 + chunk, phase_rows.stop))
            t0 = rows.stop
            if one_row and rows.stop - rows.start == 1:  # a chunk of one token
                out[rows.start], lse[rows.start], attended[rows.start], _ = self._attend_token(
                    q, metadata, rows.start, pool, geometry, params)
                continue
            groups = None
            if rowwise:
                # the gathers that fit beside the chunk's per-token tensors; the chunk ends early
                # when its tokens share less than the previous chunk's did
                max_groups = max(1, int((self.max_gather_bytes - chunk * token_bytes) // gather_bytes))
                starts, ok, raw = unit_starts(params, lens, hkv, rows, unit)  # [Hkv, n, U]
                groups, n = group_tokens(tok_req[rows], raw, max_groups, rows.stop < phase_rows.stop)
                rows = slice(rows.start, rows.start + n)
                t0 = rows.stop
                share = 1.0 if groups is None else groups.count / n
                if groups is not None and geometry.kind == "gqa" and q.device.type == "cpu":
                    lse[rows], attended[rows] = split_prefill(
                        q[rows], lens[rows].to(torch.int64), raw[:, groups.head], tok_req[rows][groups.head], groups,
                        (pages, page_start), pool, unit, geometry.sm_scale, self._rows, out[rows])
                    continue
                k, v, valid = self._gather_runs(pool, geometry, (pages, page_start), tok_req[rows],
                                                lens[rows].to(torch.int64), starts[:, :n], ok[:, :n], groups, unit,
                                                page)
            else:
                pos = selected_positions(params, lens, hkv, rows)  # [Hkv, n, K]
                valid = pos >= 0
                p = pos.clamp(min=0)
                blk = pages[page_start[tok_req[rows]].view(1, -1, 1) + p // page]
                k = k_cache[blk, heads, p % page].float()  # [Hkv, n, K, D]
                v = v_cache[blk, heads, p % page].float()
                share = 1.0
            n = valid.shape[1]
            attended[rows] = valid.sum(-1).T
            g = hq // hkv
            qs = q[rows].float().view(n, hkv, g, -1).permute(1, 0, 2, 3) * geometry.sm_scale  # [Hkv, n, g, D]
            if groups is None:
                # K as the left operand streams the gathered rows once (q @ K^T would copy K transposed)
                s = torch.matmul(k, qs.transpose(-1, -2)).transpose(-1, -2)  # [Hkv, n, g, K]
            else:  # tokens of a group share one gathered K/V: [Hkv, G, M, g, D] padded query tiles
                gid, slot, n_groups, m = groups.gid, groups.slot, groups.count, groups.largest
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
        return ("dense" if params is None else "sparse") + ("_runs" if rowwise else "_gather")

    def _attend_token(self, q: torch.Tensor, metadata: AttentionMetadata, t: int, pool: torch.Tensor,
                      geometry: AttentionGeometry, params: SparseRuntimeParams | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
        """Query row ``t`` alone (a phase or chunk of one token: the decode step of one request) over a
        contiguous HND GQA pool on CPU: the same runs and masks as the batched path, their index
        arithmetic on the host (numpy; a few hundred entries) and one K+V gather, then PyTorch's
        fused CPU flash kernel — or, where its library builds, the native kernel
        (:mod:`kvsieve.kernels.cpu.sparse_decode`) reads the runs in place instead of the gather and
        the flash kernel. A decode step's cost is mostly per-op overhead; this is about a third of
        the batched path's ops. Returns fp32 out ``[Hq, Dv]``, fp32 lse ``[Hq]``, the positions each
        KV head read, int64 ``[Hkv]``, and the path: ``"runs_native"`` or ``"runs"``."""
        hkv, d = geometry.num_kv_heads, pool.shape[-1]
        page = metadata.kv_cache_manager.tokens_per_block
        rpt = metadata.ragged_page_table
        kv_len = int(metadata.positions_host[t]) + 1
        first = int(rpt.paged_kv_indptr_buf.numpy()[metadata.token_to_req_host[t]])
        # runs of `unit` tokens, as request-local run ids [Hkv, U] (run u covers positions [u*unit, (u+1)*unit))
        if params is None:
            unit = page
            runs = np.broadcast_to(np.arange(-(-kv_len // unit)), (hkv, -(-kv_len // unit)))
        else:
            bs = params.sparse_attn_indices_block_size
            unit = math.gcd(bs, page)
            o0, o1 = params.sparse_attn_offsets.numpy()[t: t + 2].tolist()
            sel = np.sort(params.sparse_attn_indices.numpy()[:, o0:o1].astype(np.int64), axis=-1)  # [Hkv, k], -1 first
            ok = sel >= 0
            ok[:, 1:] &= sel[:, 1:] != sel[:, :-1]  # a repeated unit is read once
            if bs != unit:  # a selected block is several runs
                sel = ((sel * (bs // unit))[..., None] + np.arange(bs // unit)).reshape(hkv, -1)
                ok = np.repeat(ok, bs // unit, axis=1)
            ok &= sel * unit < kv_len
            runs = np.where(ok, sel, 0)
        per_page = page // unit
        blk = rpt.paged_kv_indices_buf.numpy()[first + (runs if per_page == 1 else runs // per_page)]  # [Hkv, U]
        # row ids in the pool viewed as [num_blocks * 2 * Hkv * per_page, unit * D] (K, then V rows)
        k_rows = blk.astype(np.int64) * (2 * hkv * per_page) + np.arange(0, hkv * per_page, per_page)[:, None]
        if per_page > 1:
            k_rows += runs % per_page
        # a run's valid positions are its first `cnt` (those before kv_len), none when not ok
        cnt = np.minimum(kv_len - runs * unit, unit) if params is None else np.where(
            ok, np.minimum(kv_len - runs * unit, unit), 0)  # [Hkv, U] (an ok run starts before kv_len)
        counts = np.full(hkv, kv_len, dtype=np.int64) if params is None else cnt.sum(-1)
        rows = pool.view(-1, unit * d)
        if supports_native(rows, q[t], hkv):  # the C kernel reads the runs in place
            try:
                o, row_lse = sparse_decode_native(rows, k_rows, cnt, hkv * per_page, q[t], sm_scale=geometry.sm_scale)
                return o, row_lse, torch.from_numpy(counts), "runs_native"
            except NativeUnavailable:
                pass
        kv = self._rows("kv", rows, torch.from_numpy(
            (k_rows.reshape(1, -1) + np.array([[0], [hkv * per_page]])).ravel())).view(2, 1, hkv, -1, d)
        k, v = kv.unbind(0)  # [1, Hkv, U*unit, D]
        qs = q[t].view(1, hkv, -1, d)  # [1, Hkv, g, D]: the KV heads as heads, a group's query heads as rows
        if qs.dtype != torch.float32:
            qs = qs.float()
        if params is None:  # dense: the valid positions are the prefix [0, kv_len) of the runs
            o, row_lse = flash_cpu(qs, k[:, :, :kv_len], v[:, :, :kv_len], None, geometry.sm_scale)
        else:
            width = int(counts[0])
            # runs are sorted, so a partial run (the newest page's written head) is the last ok one:
            # when no run that is not ok precedes an ok one, each head's valid positions are the
            # first counts[h] of its runs
            if width and bool((counts == width).all()) and (ok.all() or bool((ok[:, :-1] >= ok[:, 1:]).all())):
                # every head's valid positions are the same-length prefix: no mask, only a shorter K/V
                if width < k.shape[2]:
                    k, v = k[:, :, :width], v[:, :, :width]
                o, row_lse = flash_cpu(qs, k, v, None, geometry.sm_scale)
            else:
                valid = (np.arange(unit) < cnt[..., None]).reshape(hkv, -1)  # [Hkv, U*unit]
                bias = torch.from_numpy(np.where(valid, np.float32(0), np.float32(-np.inf)))
                o, row_lse = flash_cpu(qs, k, v, bias.view(1, hkv, 1, -1).expand(-1, -1, qs.shape[2], -1),
                                       geometry.sm_scale)
            if not counts.all():  # a head that attends nothing: out 0, lse inf
                empty = torch.from_numpy(counts == 0).view(1, hkv, 1)
                o, row_lse = o.masked_fill(empty.unsqueeze(-1), 0.0), row_lse.masked_fill(empty, torch.inf)
        return o.reshape(-1, o.shape[-1]), row_lse.reshape(-1), torch.from_numpy(counts), "runs"

    def _gather_runs(self, pool: torch.Tensor, geometry: AttentionGeometry, ragged: tuple[torch.Tensor, torch.Tensor],
                     req: torch.Tensor, lens: torch.Tensor, starts: torch.Tensor, ok: torch.Tensor,
                     groups: Groups | None, unit: int, page: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gather whole runs of ``unit`` positions as contiguous rows of the pool (``index_select``,
        one memcpy per run) instead of one row per token. GQA HND pool ``[blocks, 2, Hkv, P, D]``
        or MLA latent ``[blocks, P, R+rope]``, contiguous.

        ``req`` int64 ``[n]`` and ``lens`` int64 ``[n]`` are the tokens' requests and kv lengths,
        ``starts``/``ok`` (``[Hkv, n, U]``, as :func:`~._torch_selection.unit_starts`) their runs. A group of tokens
        shares one gather, made for the group's last token (the longest causal range, so a superset
        of the others' valid runs). Returns K ``[Hkv, G, K, D]``, V ``[Hkv, G, K, Dv]`` (fp32;
        ``G`` = groups, or tokens when ``groups`` is ``None``) and the per-token valid mask
        ``[Hkv, n, K]``."""
        hkv = geometry.num_kv_heads
        n, u = starts.shape[1], starts.shape[2]
        pos = (starts.unsqueeze(-1) + torch.arange(unit, device=starts.device)).flatten(2)  # [Hkv, n, U*unit]
        valid = ok.repeat_interleave(unit, dim=2) & (pos < lens.view(1, n, 1))
        if groups is not None:
            starts, req = starts[:, groups.last], req[groups.last]
        pages, page_start = ragged
        blk = pages[page_start[req].view(1, -1, 1) + starts // page]  # [Hkv, G, U]
        sub = (starts % page) // unit
        per_page = page // unit
        rows_g = blk.shape[1]
        if geometry.kind == "mla":
            width = pool.shape[-1]
            flat = pool.view(-1, unit * width)
            lat = self._rows("k", flat, (blk * per_page + sub).flatten()).view(1, rows_g, u * unit, width)
            return lat, lat[..., : geometry.kv_lora_rank], valid
        d = pool.shape[-1]
        flat = pool.view(-1, unit * d)
        h = torch.arange(hkv, device=blk.device).view(hkv, 1, 1)
        k_rows = ((blk * 2) * hkv + h) * per_page + sub
        k = self._rows("k", flat, k_rows.flatten()).view(hkv, rows_g, u * unit, d)
        v = self._rows("v", flat, (k_rows + hkv * per_page).flatten()).view(hkv, rows_g, u * unit, d)
        return k, v, valid

    @staticmethod
    def _width(params: SparseRuntimeParams | None, lens: torch.Tensor, rows: slice) -> int:
        """Positions gathered per query token at most (sizes the chunks)."""
        if rows.stop == rows.start:
            return 0
        if params is None:
            return int(lens[rows].max())
        longest = int(params.row_slice(rows).sparse_attn_offsets.diff().max())
        return longest * params.sparse_attn_indices_block_size
