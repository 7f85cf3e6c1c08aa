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
member reads whole and the few it reads in part (:mod:`.prefill`, no per-position tensors),
both through PyTorch's fused CPU flash-attention kernel; a chunk ends early when its gathers would
pass ``max_gather_bytes``. A phase or chunk of a single token on CPU (the decode step of one
request) takes a short path: its runs computed on the host, then the native kernel
(:mod:`kvsieve.kernels.sparse_gqa_decode.native`) reads them in place — or, where its library is
unavailable, one K+V gather and the same flash kernel.

Selections are read as sets: rows may have different lengths (``-1`` padded here), and an index
listed twice in a row (possible only with validation off) is attended once, as in the Vanilla
golden and the Triton kernels.
"""
from __future__ import annotations

import math

import torch

from ....metadata import AttentionMetadata
from ...params import SparseRuntimeParams
from ..base import AttentionBackend, AttentionGeometry, AttentionResult, BackendCapabilities, register_backend
from ..skip_tiling import RequestRows, WalkedRows, skip_softmax_phase
from .gather import gather_positions, gather_runs
from .prefill import Groups, group_tokens, split_prefill
from .scratch import ScratchPool
from .selection import selected_positions, unit_starts
from .token import attend_token, token_path

__all__ = ["TorchBackend"]

# A chunk's rows are padded to its longest row: in a causal prefill chunks of 512 rows read at
# most 511 padded positions per row (whole-prompt chunks computed the full square, 2x the work).
MAX_CHUNK_ROWS = 512


@register_backend
class TorchBackend(AttentionBackend):
    """Batched PyTorch attention over exactly the selected set; the default backend on CPU."""

    name = "torch"
    required_translations = ("ragged_page_table",)
    # skip-softmax rebuilds the Triton kernels' CPU launch table (skip_tiling): CPU only;
    # plain PyTorch: a soft-capped layer may run the plain-PyTorch softcapped attention instead
    capabilities = BackendCapabilities(skip_softmax_devices=frozenset({"cpu"}), torch_softcap=True)

    def __init__(self, max_gather_bytes: int = 256 << 20) -> None:
        self.max_gather_bytes = max_gather_bytes
        self._scratch = ScratchPool()

    def forward(self, q: torch.Tensor, metadata: AttentionMetadata, layer_idx: int, geometry: AttentionGeometry,
                params: SparseRuntimeParams | None) -> AttentionResult:
        metadata.require(f"backend {self.name!r}", self.required_translations)
        n_tok, hq = q.shape[0], q.shape[1]
        phases = metadata.phases()
        if n_tok == 1 and token_path(q, metadata, layer_idx, geometry) and not (
                params is not None and params.threshold_scale_factor(phases[0]) > 0):
            # one query token (the decode step of one request): its result is the step's
            sel = params if params is not None and params.selects_positions(phases[0]) else None
            o, row_lse, counts, path = attend_token(q, metadata, 0, metadata.kv_cache_manager.pools[layer_idx],
                                                    geometry, sel, self._scratch)
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

    def _skip_softmax(self, q: torch.Tensor, metadata: AttentionMetadata, layer_idx: int, geometry: AttentionGeometry,
                      params: SparseRuntimeParams, phase: str, rows: slice
                      ) -> tuple[torch.Tensor, torch.Tensor, int, int, str]:
        """Skip-softmax rows of ``phase``: the Triton kernels' tile walk (:mod:`..skip_tiling`) over K/V
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
        pool = mgr.pools[layer_idx]
        rowwise = pool.is_contiguous() and (geometry.kind == "mla" or mgr.spec.layout == "HND")
        rpt = metadata.ragged_page_table
        one_row = token_path(q, metadata, layer_idx, geometry)
        if one_row and phase_rows.stop - phase_rows.start == 1:  # a phase of one token: none of the set-up below
            t = phase_rows.start
            out[t], lse[t], attended[t], path = attend_token(q, metadata, t, pool, geometry, params, self._scratch)
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
        bs = 1 if params is None else params.sparse_attn_indices_block_size
        unit = page if params is None else math.gcd(bs, page)
        share = 1.0  # gathers per token in the last chunk: tokens of one group share a gather
        t0 = phase_rows.start
        while t0 < phase_rows.stop:
            chunk = max(1, min(MAX_CHUNK_ROWS, int(self.max_gather_bytes // (gather_bytes * share + token_bytes))))
            rows = slice(t0, min(t0 + chunk, phase_rows.stop))
            t0 = rows.stop
            if one_row and rows.stop - rows.start == 1:  # a chunk of one token
                out[rows.start], lse[rows.start], attended[rows.start], _ = attend_token(
                    q, metadata, rows.start, pool, geometry, params, self._scratch)
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
                        (pages, page_start), pool, unit, geometry.sm_scale, self._scratch.rows, out[rows])
                    continue
                k, v, valid = gather_runs(pool, geometry, (pages, page_start), tok_req[rows], lens[rows].to(torch.int64),
                                          starts[:, :n], ok[:, :n], groups, unit, page, self._scratch)
            else:
                k, v, valid = gather_positions(k_cache, v_cache, (pages, page_start), tok_req[rows],
                                               selected_positions(params, lens, hkv, rows), page)
                share = 1.0
            attended[rows] = valid.sum(-1).T
            out[rows], lse[rows] = masked_attention(q[rows], k, v, valid, groups, geometry.sm_scale)
        return ("dense" if params is None else "sparse") + ("_runs" if rowwise else "_gather")

    @staticmethod
    def _width(params: SparseRuntimeParams | None, lens: torch.Tensor, rows: slice) -> int:
        """Positions gathered per query token at most (sizes the chunks)."""
        if rows.stop == rows.start:
            return 0
        if params is None:
            return int(lens[rows].max())
        longest = int(params.row_slice(rows).sparse_attn_offsets.diff().max())
        return longest * params.sparse_attn_indices_block_size


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, groups: Groups | None,
                     sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 attention of ``n`` query tokens over their gathered K/V.

    ``q`` ``[n, Hq, D]`` (any float dtype); ``k`` fp32 ``[Hkv, G, K, D]``, ``v`` fp32 ``[Hkv, G, K, Dv]``
    with ``G = n`` (one gather per token) or, when ``groups`` is given, one gather per group of tokens;
    ``valid`` bool ``[Hkv, n, K]`` the positions each token reads. Returns out fp32 ``[n, Hq, Dv]`` and
    the natural-log lse fp32 ``[n, Hq]`` (a row that reads nothing: out 0, lse ``+inf``)."""
    n, hq = q.shape[0], q.shape[1]
    hkv = valid.shape[0]
    g = hq // hkv
    qs = q.float().view(n, hkv, g, -1).permute(1, 0, 2, 3) * sm_scale  # [Hkv, n, g, D]
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
    return o.permute(1, 0, 2, 3).reshape(n, hq, -1), torch.where(empty, torch.inf, row_lse).permute(1, 0, 2).reshape(n, hq)
