"""Plain-PyTorch references of the DSA lightning-indexer logits (same signatures as ``kernel.py``).

``I[t, s] = scale[s] * sum_h w[t, h] * ReLU(q[t, h] . k[s])`` in fp32, where ``scale[s]`` is the
per-token dequantization scale of an FP8 index key (1 for bf16/fp16/fp32 keys; positive, so it
factors out of the ReLU) and ``w`` already carries ``head_dim**-0.5 * n_heads**-0.5`` and any
per-(token, head) query scale. Row ``t`` has ``lens[t]`` valid columns (request-local key
positions ``0 .. lens[t]-1``); columns past it hold ``-inf``.
"""
from __future__ import annotations

import torch

from .plan import check_decode_args, check_prefill_args

__all__ = ["indexer_logits_prefill", "indexer_logits_decode", "score_keys"]

# Rows are scored in chunks whose per-row intermediate (gathered keys, or the ``[rows, H, L]``
# scores where all rows share their keys) holds about this many elements (4 MB in fp32), so it
# stays in cache: one pass over a whole 64 x 4K decode batch spent most of its time writing and
# re-reading a 33 MB fp32 copy of the keys. Chunking changes no value: each row is computed alone.
KEY_CHUNK_ELEMS = 1 << 20


def _row_chunks(t: int, width: int, per_column: int):
    """``(r0, r1)`` row ranges whose ``rows x width x per_column`` intermediate fits the chunk."""
    step = max(1, KEY_CHUNK_ELEMS // max(width * per_column, 1))
    for r0 in range(0, t, step):
        yield r0, min(t, r0 + step)


def score_keys(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, k_scale: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``[T, L]`` for ``q [T, H, D]`` against ``k [T, L, D]`` (per-row keys) or ``[L, D]``
    (keys every row shares), ``k_scale [T, L]`` or ``[L]`` alike."""
    s = torch.einsum("thd,tld->thl" if k.dim() == 3 else "thd,ld->thl", q.float(), k.float()).relu_()
    out = torch.einsum("th,thl->tl", weights.float(), s)
    return out if k_scale is None else out * k_scale.float()


def _mask(out: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    valid = torch.arange(out.shape[1], device=out.device) < lens.to(torch.int64).unsqueeze(1)
    return out.masked_fill(~valid, float("-inf"))


def indexer_logits_prefill(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor | None, weights: torch.Tensor,
                           k_start: torch.Tensor, k_len: torch.Tensor, width: int) -> torch.Tensor:
    """Ragged prefill logits: row ``t`` scores keys ``k[k_start[t] + j]``, ``j < k_len[t]``.

    Args:
        q: ``[T, H, D]`` fp32/fp16/bf16/float8_e4m3fn index queries (RoPE applied).
        k: ``[S_kv, D]`` index keys of the batch's requests back to back, unit stride along D.
        k_scale: ``[S_kv]`` fp32 per-key scales (FP8 keys) or ``None``.
        weights: ``[T, H]`` fp32 head weights (scales folded in).
        k_start, k_len: ``[T]`` int32 first key row and causal length of each query row.
        width: columns of the result (>= max ``k_len``).

    Returns:
        fp32 ``[T, width]``, column ``j`` = request-local key ``j``; ``-inf`` past ``k_len[t]``.
    """
    check_prefill_args(q, k, k_scale, weights, k_start, k_len, width)
    t = q.shape[0]
    out = torch.full((t, width), float("-inf"), dtype=torch.float32, device=q.device)
    pos = torch.arange(width, device=q.device)
    rows = (k_start.to(torch.int64).unsqueeze(1) + pos).clamp(max=max(k.shape[0] - 1, 0))
    if not (t and width and k.shape[0]):
        return out
    if bool((k_start == k_start[0]).all()):  # one request's rows: every row reads the same keys
        keys = k[rows[0]].float()  # [width, D], upcast once
        scale = None if k_scale is None else k_scale[rows[0]]
        for r0, r1 in _row_chunks(t, width, weights.shape[1]):
            out[r0:r1] = score_keys(q[r0:r1], keys, weights[r0:r1], scale)
    else:
        for r0, r1 in _row_chunks(t, width, k.shape[-1]):
            scale = None if k_scale is None else k_scale[rows[r0:r1]]
            out[r0:r1] = score_keys(q[r0:r1], k[rows[r0:r1]], weights[r0:r1], scale)
    return _mask(out, k_len)


def indexer_logits_decode(q: torch.Tensor, k_cache: torch.Tensor, k_scale_cache: torch.Tensor | None,
                          weights: torch.Tensor, block_table: torch.Tensor, token_to_req: torch.Tensor,
                          kv_lens: torch.Tensor, width: int) -> torch.Tensor:
    """Paged logits: row ``t`` scores its request's keys ``0 .. kv_lens[t]-1`` through the block table.

    Args:
        q, weights: as in :func:`indexer_logits_prefill`.
        k_cache: ``[num_blocks, page_size, D]`` the index-K aux pool (rows share the main cache's
            block ids; block 0 is the sentinel).
        k_scale_cache: ``[num_blocks, page_size]`` fp32 scales or ``None``.
        block_table: ``[batch, max_blocks]`` int32; ``token_to_req``, ``kv_lens``: ``[T]`` int32.
        width: columns of the result (>= max ``kv_lens``).

    Returns:
        fp32 ``[T, width]``; ``-inf`` past ``kv_lens[t]``.
    """
    check_decode_args(q, k_cache, k_scale_cache, weights, block_table, token_to_req, kv_lens, width)
    t = q.shape[0]
    page = k_cache.shape[1]
    if t == 0 or width == 0:
        return torch.empty(t, width, dtype=torch.float32, device=q.device)
    # whole blocks per row (block j of row t holds its request's keys j*page .. j*page+page-1)
    cols = torch.arange(-(-width // page), device=q.device).clamp(max=block_table.shape[1] - 1)
    table = block_table[token_to_req.long()][:, cols].long()  # [T, ceil(width/page)]
    out = torch.empty(t, width, dtype=torch.float32, device=q.device)
    for r0, r1 in _row_chunks(t, width, k_cache.shape[-1]):
        blk = table[r0:r1].reshape(-1)
        keys = k_cache.index_select(0, blk).view(r1 - r0, -1, k_cache.shape[-1])[:, :width]  # [rows, width, D]
        scale = None if k_scale_cache is None else k_scale_cache.index_select(0, blk).view(r1 - r0, -1)[:, :width]
        out[r0:r1] = score_keys(q[r0:r1], keys, weights[r0:r1], scale)
    return _mask(out, kv_lens)
