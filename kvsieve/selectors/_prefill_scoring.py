"""Stage 1 of RocketKV, i.e. SnapKV-style prompt eviction, shared by ``rocketkv`` and ``snapkv``.

For a prompt of ``L >= budget`` tokens: the last ``window`` queries score the ``L - window``
prefix keys (softmax over the prefix keys, in fp32, scale ``sm_scale``), the probabilities are
summed over the window queries and over the query heads of each KV group, smoothed with a 1-D
max-pool of odd width ``kernel`` (stride 1, padding ``kernel // 2``), and the top
``budget - window`` prefix positions (ties to the lower position) plus the window are kept,
ascending. Shorter prompts keep everything. Output per context request: int32 ``[Hkv, n_keep]``.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from ..sparse import SelectorInputs
from ._paged import gather_padded_keys, top_units

__all__ = ["PromptBudget", "check_prompt_budget", "snap_keep_golden", "snap_keep", "pack_kept"]


class PromptBudget(NamedTuple):
    """The three stage-1 knobs (validated by the owning config with :func:`check_prompt_budget`)."""

    window: int
    kernel: int
    budget: int


def check_prompt_budget(owner: str, window_size: int, kernel_size: int, prompt_budget: int) -> None:
    """Raise ``ValueError`` naming the field and its accepted range."""
    if prompt_budget < 1:
        raise ValueError(f"{owner}: prompt_budget must be >= 1, got {prompt_budget}")
    if not 1 <= window_size <= prompt_budget:
        raise ValueError(f"{owner}: window_size must be in [1, prompt_budget={prompt_budget}], got {window_size}")
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"{owner}: kernel_size must be an odd integer >= 1 (1, 3, 5, ...), got {kernel_size}")


def _context_lengths(inputs: SelectorInputs) -> np.ndarray:
    """Prompt length per context request; rejects chunked prefill (stage 1 needs the whole prompt)."""
    md = inputs.metadata
    lens = md.kv_lens_host[: md.num_contexts].astype(np.int64)
    q_lens = np.diff(md.query_start_host[: md.num_contexts + 1]).astype(np.int64)
    if bool((q_lens != lens).any()):
        raise ValueError("prompt eviction (snapkv/rocketkv stage 1) needs the whole prompt in one step; "
                         "chunked prefill is not supported")
    return lens


def _pool(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """1-D max-pool over the last dim of ``[..., P]`` (odd ``kernel``, stride 1, same length)."""
    shape = scores.shape
    pooled = F.max_pool1d(scores.reshape(-1, 1, shape[-1]), kernel, stride=1, padding=kernel // 2)
    return pooled.reshape(shape)


def snap_keep_golden(inputs: SelectorInputs, cfg: PromptBudget) -> list[torch.Tensor]:
    """Per-request, per-head, per-query loops in plain PyTorch: the reference of :func:`snap_keep`."""
    kept = []
    for i, n in enumerate(_context_lengths(inputs).tolist()):
        hkv = inputs.num_kv_heads
        if n < cfg.budget:
            kept.append(torch.arange(n, dtype=torch.int32).expand(hkv, n).to(inputs.q.device))
            continue
        _, t1 = inputs.query_range(i)
        prefix = n - cfg.window
        keys = inputs.request_keys(i)[:prefix].float()  # [P, Hkv, D]
        q_win = inputs.q[t1 - cfg.window: t1].float()  # [W, Hq, D]
        rows = []
        for h in range(hkv):
            score = torch.zeros(prefix, device=keys.device)
            for g in range(inputs.group_size):
                for w in range(cfg.window):
                    logits = keys[:, h] @ q_win[w, h * inputs.group_size + g] * inputs.sm_scale
                    score += torch.softmax(logits, dim=0)
            pooled = _pool(score, cfg.kernel)
            top = top_units(pooled, cfg.budget - cfg.window).sort().values
            rows.append(torch.cat([top, torch.arange(prefix, n, device=top.device)]))
        kept.append(torch.stack(rows).to(torch.int32))
    return kept


def snap_keep(inputs: SelectorInputs, cfg: PromptBudget) -> list[torch.Tensor]:
    """Batched over every long context request (padded keys, one einsum); same result as the golden."""
    lens = _context_lengths(inputs)
    hkv, g, dev = inputs.num_kv_heads, inputs.group_size, inputs.q.device
    kept: list[torch.Tensor] = [torch.arange(n, dtype=torch.int32, device=dev).expand(hkv, n) for n in lens.tolist()]
    long = np.nonzero(lens >= cfg.budget)[0]
    if long.size == 0:
        return kept
    md = inputs.metadata
    prefix = lens[long] - cfg.window
    keys, valid = gather_padded_keys(inputs.cache, inputs.layer_idx, md.slots[long], prefix)  # [B, P, Hkv, D]
    ends = torch.as_tensor(md.query_start_host[long + 1].astype(np.int64), device=dev)
    rows = ends.unsqueeze(1) - cfg.window + torch.arange(cfg.window, device=dev)  # [B, W]
    q_win = inputs.q[rows].float().view(len(long), cfg.window, hkv, g, -1)  # [B, W, Hkv, G, D]
    logits = torch.einsum("bwhgd,bphd->bhgwp", q_win, keys.float()) * inputs.sm_scale
    logits = logits.masked_fill(~valid[:, None, None, None, :], float("-inf"))
    score = torch.softmax(logits, dim=-1).sum(dim=(2, 3))  # [B, Hkv, P]
    pooled = _pool(score, cfg.kernel).masked_fill(~valid.unsqueeze(1), float("-inf"))
    top = top_units(pooled, cfg.budget - cfg.window).sort(dim=-1).values  # [B, Hkv, budget - W]
    for b, i in enumerate(long.tolist()):
        window = torch.arange(int(prefix[b]), int(lens[i]), device=dev).expand(hkv, cfg.window)
        kept[i] = torch.cat([top[b], window], dim=1).to(torch.int32)
    return kept


def pack_kept(kept: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(sparse_kv_indices [Hkv, total], sparse_kv_offsets [num_contexts + 1])`` or ``None`` when
    no request drops anything (then no compaction runs)."""
    if not kept:
        return None
    counts = torch.tensor([0] + [k.shape[1] for k in kept], dtype=torch.int64)
    if all(k.shape[1] == 0 or bool((k[:, -1] == k.shape[1] - 1).all()) for k in kept):
        return None
    offsets = torch.cumsum(counts, 0).to(torch.int32).to(kept[0].device)
    return torch.cat(kept, dim=1).contiguous(), offsets
