"""Index translation and cost accounting for sparse selections (plain vectorised torch), shared by
the CuTe host (physical slots) and the sparse layer (what a paged kernel really reads)."""
from __future__ import annotations

import torch

from .checks import check_positive_int, check_shape, check_tensor


def _entry_tokens(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """Query token owning each selection entry ``[total]`` int64 (no device sync)."""
    entries = torch.arange(total, device=offsets.device, dtype=offsets.dtype)
    return torch.bucketize(entries, offsets[1:], right=True).long()


def to_physical_slots(indices: torch.Tensor, offsets: torch.Tensor, token_to_req: torch.Tensor,
                      block_table: torch.Tensor, page_size: int,
                      block_size: int = 1) -> torch.Tensor:
    """Translate request-local selections into physical cache slots (FlashMLA/FlashInfer interop).

    Args:
        indices: ``[num_kv_heads, total_selected]`` int32 request-local positions
            (``block_size == 1``) or block ids (``block_size == page_size``); -1 = padding.
            Valid entries must address pages inside the request's block-table row.
        offsets: ``[num_tokens + 1]`` int32; token ``t`` owns entries ``offsets[t]:offsets[t+1]``.
        token_to_req: ``[num_tokens]`` int32 block-table row of each token.
        block_table: ``[batch, max_blocks_per_seq]`` int32.
        page_size: tokens per KV page.
        block_size: 1 (token entries) or ``page_size`` (page-aligned block entries).

    Returns:
        int32 tensor shaped like ``indices``: ``page * page_size + offset`` for a token entry,
        ``page * page_size`` (the page's first slot) for a block entry, -1 kept. FlashMLA's
        sparse decode takes token-level global slots as ``[num_tokens, topk]``: for
        ``num_kv_heads == 1`` and a fixed top-k, ``out.view(num_tokens, topk)`` is that tensor
        (with the pool viewed as ``[num_blocks * page_size, 1, D]``); FlashInfer's sparse page
        indices are ``out // page_size`` for block entries.
    """
    check_tensor("indices", indices, 2, (torch.int32,))
    dev = indices.device
    check_tensor("offsets", offsets, 1, (torch.int32,), dev)
    check_tensor("token_to_req", token_to_req, 1, (torch.int32,), dev)
    check_tensor("block_table", block_table, 2, (torch.int32,), dev)
    check_shape("offsets", offsets, (token_to_req.shape[0] + 1,))
    check_positive_int("page_size", page_size)
    check_positive_int("block_size", block_size)
    if block_size not in (1, page_size):
        raise ValueError(f"block_size: expected 1 or page_size ({page_size}), got {block_size}")
    tok = _entry_tokens(offsets, indices.shape[1])
    req = token_to_req.long()[tok]
    idx = indices.long()
    pos = idx * block_size
    valid = idx >= 0
    safe = torch.where(valid, pos, torch.zeros_like(pos))
    page = block_table.long()[req.expand_as(safe), safe // page_size]
    slots = page * page_size + safe % page_size
    return torch.where(valid, slots, torch.full_like(slots, -1)).to(torch.int32)


def effective_attended_tokens(indices: torch.Tensor, offsets: torch.Tensor,
                              kv_lens: torch.Tensor, block_size: int,
                              page_size: int) -> torch.Tensor:
    """Token positions a paged kernel really reads for each (query token, KV head).

    Expands block entries to positions ``[i*S, (i+1)*S)``, clips to ``kv_lens[t]``, rounds
    up to whole KV pages, deduplicates pages and counts the valid positions of those pages
    (a page's tokens beyond ``kv_lens[t]`` are not counted). -1 entries and entries at or
    beyond ``kv_lens[t]`` cost nothing.

    Args:
        indices: ``[num_kv_heads, total_selected]`` int32; offsets ``[num_tokens + 1]`` int32;
        kv_lens: ``[num_tokens]`` int32; block_size ``S`` >= 1; page_size >= 1.

    Returns:
        ``[num_tokens, num_kv_heads]`` int32. Reads ``kv_lens.max()`` on the host (one sync)
        to size the per-token page mask.
    """
    check_tensor("indices", indices, 2, (torch.int32,))
    dev = indices.device
    check_tensor("offsets", offsets, 1, (torch.int32,), dev)
    check_tensor("kv_lens", kv_lens, 1, (torch.int32,), dev)
    check_shape("offsets", offsets, (kv_lens.shape[0] + 1,))
    check_positive_int("block_size", block_size)
    check_positive_int("page_size", page_size)
    num_tokens, (num_kv_heads, total) = kv_lens.shape[0], indices.shape
    lens = kv_lens.long()
    max_pages = -(-int(lens.max()) // page_size) if num_tokens else 0
    mask = torch.zeros(num_tokens, num_kv_heads, max_pages + 1, dtype=torch.bool, device=dev)
    tok = _entry_tokens(offsets, total).expand(num_kv_heads, total)
    head = torch.arange(num_kv_heads, device=dev)[:, None].expand(num_kv_heads, total)
    idx = indices.long()
    lo = idx * block_size
    hi = torch.minimum(lo + block_size, lens[tok])  # exclusive, clipped to kv_len
    valid = (idx >= 0) & (lo < hi)
    first, last = lo // page_size, (hi - 1) // page_size
    for k in range(-(-block_size // page_size) + 1):  # pages a block can straddle
        page = first + k
        ok = valid & (page <= last)
        mask[tok, head, torch.where(ok, page, torch.full_like(page, max_pages))] = True
    mask = mask[..., :max_pages]
    page_start = torch.arange(max_pages, device=dev) * page_size
    per_page = (lens[:, None] - page_start[None, :]).clamp(0, page_size)
    return (mask * per_page[:, None, :]).sum(-1).to(torch.int32)
