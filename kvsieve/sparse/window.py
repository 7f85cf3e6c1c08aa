"""A sliding-window layer's window, applied to a step's selection in one place.

A query whose ``kv_len`` is ``n`` on a layer with window ``W`` attends only ``[n - W, n)``.
:class:`~kvsieve.sparse.SparseAttention` applies the window here for every backend that does not
declare ``BackendCapabilities.window`` (the core backends), so a backend on its own never reads
outside the window; the selector is told the window too (:attr:`SelectorInputs.window`).
"""
from __future__ import annotations

import torch

from ..metadata import PHASES, AttentionMetadata
from .backends.torch_backend.selection import selected_positions
from .params import SparseRuntimeParams

__all__ = ["window_counts", "window_params"]


def window_params(params: SparseRuntimeParams | None, metadata: AttentionMetadata, num_kv_heads: int,
                  window: int) -> SparseRuntimeParams:
    """``params`` restricted to each query's last ``window`` positions ``[kv_len - window, kv_len)``
    as a token selection of every phase (block size 1, ``[T, Hkv, <= window]`` packed by
    :meth:`SparseRuntimeParams.from_topk`); every other field of ``params`` is kept.

    Rows of a phase ``params`` does not select (or ``params=None``) get the window alone; rows it
    selects keep their selected positions (blocks expanded to tokens) inside the window.
    """
    token_kv_lens = metadata.token_kv_lens
    lens = token_kv_lens.to(torch.int64)
    t = lens.numel()
    lo = (lens - window).clamp_min(0)  # [T]
    pos = lo.view(t, 1) + torch.arange(window, device=lens.device)  # [T, W]
    pos = torch.where(pos < lens.view(t, 1), pos, -1).unsqueeze(1).expand(t, num_kv_heads, window).clone()
    for phase in metadata.phases():
        if params is None or not params.selects_positions(phase):
            continue
        rows = metadata.phase_rows(phase)
        sel = selected_positions(params, token_kv_lens, num_kv_heads, rows).transpose(0, 1)  # [n, Hkv, K]
        sel = torch.where(sel >= lo[rows].view(-1, 1, 1), sel, -1)
        sel = SparseRuntimeParams.sort_padding_last(sel)[..., :window]
        pos[rows] = torch.nn.functional.pad(sel, (0, window - sel.shape[-1]), value=-1)
    fields = {} if params is None else {k: getattr(params, k) for k in (
        "sparse_kv_indices", "sparse_kv_offsets", "threshold_scale_factor_context",
        "threshold_scale_factor_generation")}
    return SparseRuntimeParams.from_topk(pos.to(torch.int32).contiguous(), block_size=1,
                                         selected_phases=frozenset(PHASES), **fields)


def window_counts(token_kv_lens: torch.Tensor, num_kv_heads: int, window: int, page_size: int = 1) -> torch.Tensor:
    """Host int64 ``[num_tokens, num_kv_heads]``: positions each dense query of a layer with
    ``window`` reads, ``[kv_len - window, kv_len)``, rounded out to whole pages of ``page_size``
    (clipped to ``kv_len``) as a page-gathering kernel pays. It equals
    :func:`~kvsieve.sparse.selection.attended_counts` of ``window_params(None, ...)``, counted from
    the lengths alone: that selection holds ``num_tokens * num_kv_heads * window`` indices, and
    counting it for a long prompt's prefill costs more than the attention."""
    lens = token_kv_lens.to(torch.int64).cpu()
    first = (lens - window).clamp_min(0) // page_size * page_size  # the first position of the first page read
    return (lens - first).unsqueeze(1).expand(lens.numel(), num_kv_heads).clone()
