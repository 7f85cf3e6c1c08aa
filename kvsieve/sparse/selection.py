"""Selections as masks and counts, in plain PyTorch (shared by the golden and the reports)."""
from __future__ import annotations

import torch

from ..kernels.common.indexing import effective_attended_tokens
from .params import SparseRuntimeParams

__all__ = ["selection_mask", "attended_counts", "unique_sorted_segments"]


def selection_mask(params: SparseRuntimeParams | None, rows: slice, token_kv_lens: torch.Tensor,
                   kv_len: int, num_kv_heads: int) -> torch.Tensor:
    """Boolean ``[num_kv_heads, n_rows, kv_len]``: which positions each query row attends.

    ``rows`` selects query tokens ``[start, stop)`` (one request); ``token_kv_lens [num_tokens]``
    bounds each row causally. ``params=None`` (or no attention indices) means dense-causal; the
    caller passes ``None`` for rows of a phase the params do not select
    (:meth:`SparseRuntimeParams.selects_positions`).
    Block entries ``i`` cover ``[i*B, (i+1)*B)``; ``-1`` and out-of-range entries select nothing.
    """
    lens = token_kv_lens[rows].to(torch.int64).cpu()
    n = lens.numel()
    pos = torch.arange(kv_len)
    causal = pos.unsqueeze(0) < lens.unsqueeze(1)  # [n, L]
    if params is None or params.sparse_attn_indices is None:
        return causal.unsqueeze(0).expand(num_kv_heads, n, kv_len).clone()
    bs = params.sparse_attn_indices_block_size
    idx = params.sparse_attn_indices.cpu().to(torch.int64)
    off = params.sparse_attn_offsets.cpu().to(torch.int64)
    num_units = -(-kv_len // bs)
    mask = torch.zeros(num_kv_heads, n, num_units + 1, dtype=torch.bool)  # last column collects junk
    for r in range(n):
        t = rows.start + r
        sel = idx[:, off[t]: off[t + 1]]  # [Hkv, k]
        sel = torch.where((sel >= 0) & (sel < num_units), sel, num_units)
        mask[:, r].scatter_(1, sel, True)
    mask = mask[:, :, :num_units].repeat_interleave(bs, dim=2)[:, :, :kv_len]
    return mask & causal.unsqueeze(0)


def attended_counts(params: SparseRuntimeParams | None, token_kv_lens: torch.Tensor, num_kv_heads: int,
                    page_size: int = 1, selected_rows: list[slice] | None = None) -> torch.Tensor:
    """int64 ``[num_tokens, num_kv_heads]``: positions read per query after rounding to pages.

    ``selected_rows``: the row slices that read the selection (``None``: every row when
    ``params`` has attention indices); all other rows are dense and read ``token_kv_lens``.
    ``page_size=1`` counts exact tokens (what the Vanilla golden reads). With ``page_size > 1``
    every touched page counts whole (clipped to the query's valid length), which is what a
    page-gathering kernel pays (``kvsieve.kernels.common.indexing.effective_attended_tokens``).
    """
    lens = token_kv_lens.to(torch.int64)
    counts = lens.unsqueeze(1).expand(lens.numel(), num_kv_heads).cpu().clone()
    if params is None or params.sparse_attn_indices is None:
        return counts
    if selected_rows is None:
        selected_rows = [slice(0, lens.numel())]
    if not any(r.stop > r.start for r in selected_rows):
        return counts
    sparse = effective_attended_tokens(params.sparse_attn_indices, params.sparse_attn_offsets,
                                       token_kv_lens.to(torch.int32), params.sparse_attn_indices_block_size, page_size)
    sparse = sparse.to(torch.int64).cpu()
    for rows in selected_rows:
        counts[rows] = sparse[rows]
    return counts


def unique_sorted_segments(indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``indices [Hkv, total]`` with each segment ``offsets[t]:offsets[t+1]`` sorted ascending, each
    unit once, ``-1`` padding at the tail (same shape and dtype): the set the segment names.

    The carrier promises ascending unique segments, but with validation off nothing enforces it;
    backends whose kernels walk the list as given read it through this, so a repeated index is
    attended once in every backend (as the mask-based Vanilla golden does).
    """
    total = indices.shape[1]
    if total == 0:
        return indices
    off = offsets.to(torch.int64)
    row = torch.repeat_interleave(torch.arange(off.numel() - 1, device=indices.device), off.diff(),
                                  output_size=total)
    idx = indices.to(torch.int64)
    pad = 1 << 31  # above every valid unit (int32): sorts to the tail of its segment
    key = torch.where(idx < 0, pad, idx)
    span = pad + 1
    comp = (row * span).unsqueeze(0) + key
    comp = comp.sort(dim=1).values
    repeat = torch.zeros_like(comp, dtype=torch.bool)
    repeat[:, 1:] = comp[:, 1:] == comp[:, :-1]
    comp = torch.where(repeat, (row * span).unsqueeze(0) + pad, comp).sort(dim=1).values
    unit = comp - (row * span).unsqueeze(0)
    return torch.where(unit >= pad, -1, unit).to(indices.dtype)
