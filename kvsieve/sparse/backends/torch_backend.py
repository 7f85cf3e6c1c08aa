"""The CPU fast path: batched gather of the selected KV through the block table, then one fused
masked-softmax attention per chunk of query tokens — no per-request Python loop.

For every (query token, KV head) the backend builds the request-local positions it reads
(``[Hkv, T, K]``, ``-1`` = nothing): the selection expanded from blocks to tokens, or
``[0, kv_len)`` for dense layers. Positions map to ``(block, offset)`` through the block table, K
and V rows are gathered in one advanced-indexing op, and attention runs in fp32. Query tokens
are processed in chunks sized so the gathered tile stays under ``max_gather_bytes``.
"""
from __future__ import annotations

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
        off = params.sparse_attn_offsets.to(torch.int64)
        start, stop = int(off[rows.start]), int(off[rows.stop])
        k = (stop - start) // n if n else 0
        if n and off[rows.start: rows.stop + 1].diff().ne(k).any():
            raise ValueError("the torch backend needs equal selection lengths for the query tokens of a step "
                             "(as from SparseRuntimeParams.from_topk)")
        sel = params.sparse_attn_indices[:, start:stop].to(torch.int64).view(num_kv_heads, n, k)
        bs = params.sparse_attn_indices_block_size
        if bs > 1:
            sel = (sel.unsqueeze(-1) * bs + torch.arange(bs, device=sel.device)).masked_fill(sel.unsqueeze(-1) < 0, -1)
            sel = sel.flatten(2)
        pos = sel
    return torch.where((pos >= 0) & (pos < lens.view(1, n, 1)), pos, -1)


class TorchBackend(AttentionBackend):
    """Batched PyTorch attention over exactly the selected set; the default backend on CPU."""

    name = "torch"
    devices = frozenset({"cpu", "cuda"})

    def __init__(self, max_gather_bytes: int = 256 << 20) -> None:
        self.max_gather_bytes = max_gather_bytes

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
        for t0 in range(0, n_tok, chunk):
            rows = slice(t0, min(t0 + chunk, n_tok))
            pos = selected_positions(params, lens, hkv, rows)  # [Hkv, n, K]
            valid = pos >= 0
            p = pos.clamp(min=0)
            blk = table[tok_req[rows]].view(1, -1, table.shape[1]).expand(hkv, -1, -1).gather(2, p // page)
            k = k_cache[blk, heads, p % page].float()  # [Hkv, n, K, D]
            v = v_cache[blk, heads, p % page].float()
            n = k.shape[1]
            qf = q[rows].float().view(n, hkv, hq // hkv, -1).permute(1, 0, 2, 3)  # [Hkv, n, g, D]
            s = torch.matmul(qf, k.transpose(-1, -2)) * geometry.sm_scale  # [Hkv, n, g, K]
            s = s.masked_fill(~valid.unsqueeze(2), float("-inf"))
            row_lse = torch.logsumexp(s, dim=-1)
            empty = torch.isneginf(row_lse)
            prob = torch.exp(s - torch.where(empty, 0.0, row_lse).unsqueeze(-1))
            o = torch.matmul(prob, v)  # [Hkv, n, g, Dv]
            out[rows] = o.permute(1, 0, 2, 3).reshape(n, hq, -1)
            lse[rows] = torch.where(empty, torch.inf, row_lse).permute(1, 0, 2).reshape(n, hq)
        return out.to(q.dtype), lse

    @staticmethod
    def _width(params: SparseRuntimeParams | None, lens: torch.Tensor) -> int:
        if params is None or params.sparse_attn_indices is None:
            return int(lens.max())
        total = params.sparse_attn_indices.shape[1]
        return total // max(lens.numel(), 1) * params.sparse_attn_indices_block_size
