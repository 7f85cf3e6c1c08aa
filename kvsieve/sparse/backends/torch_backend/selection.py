"""Which KV positions the Torch backend reads per (query token, KV head): the selection of a
carrier expanded from blocks to positions (:func:`selected_positions`) or to runs of a unit
(:func:`unit_starts`), each selected unit once, ``-1``/unused past a token's ``kv_len``."""
from __future__ import annotations

import torch

from ...params import SparseRuntimeParams

__all__ = ["selected_positions", "unit_starts"]

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
    """int64 ``[Hkv, n, k]`` selected units of query tokens ``rows`` (ascending, each unit once,
    ``-1`` for padding and repeats; ``k`` the longest row) and the unit (block) size."""
    part = params.row_slice(rows)
    off = part.sparse_attn_offsets.to(torch.int64)
    lens = off.diff()
    k = int(lens.max()) if n else 0
    j = torch.arange(k, device=off.device)
    at = (off[:-1].unsqueeze(1) + j).clamp(max=max(part.sparse_attn_indices.shape[1] - 1, 0))  # [n, k]
    # the rows' entries first, then int64: converting the whole carrier per chunk made a long
    # token-sparse prefill quadratic (16K rows x 4K entries, copied once per chunk of ~10 rows)
    sel = part.sparse_attn_indices[:, at].to(torch.int64) if k else off.new_zeros(num_kv_heads, n, 0)
    sel = SparseRuntimeParams.sort_padding_last(torch.where(j < lens.unsqueeze(1), sel, -1))
    repeat = torch.zeros_like(sel, dtype=torch.bool)
    repeat[..., 1:] = (sel[..., 1:] == sel[..., :-1]) & (sel[..., 1:] >= 0)
    sel = torch.where(repeat, -1, sel)
    return sel, params.sparse_attn_indices_block_size


def unit_starts(params: SparseRuntimeParams | None, lens: torch.Tensor, num_kv_heads: int, rows: slice,
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
