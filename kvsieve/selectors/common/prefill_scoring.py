"""Stage 1 of RocketKV, i.e. SnapKV-style prompt eviction, shared by ``rocketkv`` and ``snapkv``.

For a prompt of ``L >= budget`` tokens, the last ``window`` queries vote for the ``L - window``
prefix keys (fp32, scale ``sm_scale``):

* ``softmax_over``: ``"prefix"`` = softmax over the prefix keys only; ``"all"`` = softmax over
  every key the window query sees (the prefix and the window up to itself, causally), then the
  prefix part is kept;
* the probabilities are summed over the window queries;
* ``group_sum``: ``"before_pool"`` = summed over the query heads of each KV group, then pooled;
  ``"after_pool"`` = each query head pooled, then summed over the group;
* ``pooling``: a 1-D ``"max"`` or ``"avg"`` pool of odd width ``kernel`` (stride 1, padding
  ``kernel // 2``; the average counts the zero padding, as ``F.avg_pool1d`` does by default).

(A sum where a reference takes a mean only scales every score by the same factor.) The top
``budget - window`` prefix positions (ties to the lower position) plus the window are kept,
ascending. Shorter prompts keep everything. Output per context request: int32 ``[Hkv, n_keep]``.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from ...sparse import SelectorInputs
from ...sparse.knobs import KnobError
from .paged import gather_padded_keys, top_units

__all__ = ["PromptBudget", "POOLINGS", "SOFTMAX_OVER", "GROUP_SUMS", "check_prompt_budget", "snap_keep_naive",
           "snap_keep", "pack_kept"]

POOLINGS = ("max", "avg")
SOFTMAX_OVER = ("prefix", "all")
GROUP_SUMS = ("before_pool", "after_pool")


class PromptBudget(NamedTuple):
    """The stage-1 knobs (the first three validated by the owning config with
    :func:`check_prompt_budget`, the others by its knob choices; module docstring)."""

    window: int
    kernel: int
    budget: int
    pooling: str
    softmax_over: str
    group_sum: str


def check_prompt_budget(owner: str, window_size: int, kernel_size: int, prompt_budget: int) -> None:
    """The checks :func:`~kvsieve.sparse.knobs.check_knobs` cannot state (its ranges come first);
    raise :class:`KnobError` naming ``owner.knob``."""
    if window_size > prompt_budget:
        raise KnobError(f"{owner}.window_size must be <= prompt_budget={prompt_budget}, got {window_size}")
    if kernel_size % 2 == 0:
        raise KnobError(f"{owner}.kernel_size must be odd (1, 3, 5, ...), got {kernel_size}")


def _context_lengths(inputs: SelectorInputs) -> np.ndarray:
    """Prompt length per context request; rejects chunked prefill (stage 1 needs the whole prompt)."""
    md = inputs.metadata
    lens = md.kv_lens_host[: md.num_contexts].astype(np.int64)
    q_lens = np.diff(md.query_start_host[: md.num_contexts + 1]).astype(np.int64)
    if bool((q_lens != lens).any()):
        raise ValueError("prompt eviction (snapkv/rocketkv stage 1) needs the whole prompt in one step; "
                         "chunked prefill is not supported")
    return lens


def _pool(scores: torch.Tensor, cfg: PromptBudget) -> torch.Tensor:
    """1-D max- or average-pool over the last dim of ``[..., P]`` (odd kernel, stride 1, same length)."""
    shape, k = scores.shape, cfg.kernel
    pool = F.max_pool1d if cfg.pooling == "max" else F.avg_pool1d
    return pool(scores.reshape(-1, 1, shape[-1]), k, stride=1, padding=k // 2).reshape(shape)


def snap_keep_naive(inputs: SelectorInputs, cfg: PromptBudget) -> list[torch.Tensor]:
    """Per-request, per-head, per-query loops in plain PyTorch: the reference of :func:`snap_keep`."""
    kept = []
    for i, n in enumerate(_context_lengths(inputs).tolist()):
        hkv = inputs.num_kv_heads
        if n < cfg.budget:
            kept.append(torch.arange(n, dtype=torch.int32).expand(hkv, n).to(inputs.q.device))
            continue
        _, t1 = inputs.query_range(i)
        prefix = n - cfg.window
        keys = inputs.request_keys(i).float()  # [n, Hkv, D]
        q_win = inputs.q[t1 - cfg.window: t1].float()  # [W, Hq, D]
        rows = []
        for h in range(hkv):
            votes = []  # per query head of the group: [P]
            for g in range(inputs.group_size):
                score = torch.zeros(prefix, device=keys.device)
                for w in range(cfg.window):
                    seen = prefix + w + 1 if cfg.softmax_over == "all" else prefix
                    logits = keys[:seen, h] @ q_win[w, h * inputs.group_size + g] * inputs.sm_scale
                    score += torch.softmax(logits, dim=0)[:prefix]
                votes.append(score)
            if cfg.group_sum == "before_pool":
                pooled = _pool(torch.stack(votes).sum(0), cfg)
            else:
                pooled = torch.stack([_pool(v, cfg) for v in votes]).sum(0)
            top = top_units(pooled, cfg.budget - cfg.window).sort().values
            rows.append(torch.cat([top, torch.arange(prefix, n, device=top.device)]))
        kept.append(torch.stack(rows).to(torch.int32))
    return kept


def snap_keep(inputs: SelectorInputs, cfg: PromptBudget) -> list[torch.Tensor]:
    """Batched over every long context request (padded keys, one einsum); same result as :func:`snap_keep_naive`."""
    lens = _context_lengths(inputs)
    hkv, g, dev = inputs.num_kv_heads, inputs.group_size, inputs.q.device
    kept: list[torch.Tensor] = [torch.arange(n, dtype=torch.int32, device=dev).expand(hkv, n) for n in lens.tolist()]
    long = np.nonzero(lens >= cfg.budget)[0]
    if long.size == 0:
        return kept
    md = inputs.metadata
    prefix = lens[long] - cfg.window
    seen = lens[long] if cfg.softmax_over == "all" else prefix
    keys, valid = gather_padded_keys(inputs.cache, inputs.layer_idx, md.slots[long], seen)  # [B, S, Hkv, D]
    ends = torch.as_tensor(md.query_start_host[long + 1].astype(np.int64), device=dev)
    rows = ends.unsqueeze(1) - cfg.window + torch.arange(cfg.window, device=dev)  # [B, W]
    q_win = inputs.q[rows].float().view(len(long), cfg.window, hkv, g, -1)  # [B, W, Hkv, G, D]
    logits = torch.einsum("bwhgd,bphd->bhgwp", q_win, keys.float()) * inputs.sm_scale
    pos = torch.arange(keys.shape[1], device=dev)
    pre = torch.as_tensor(prefix, device=dev)  # [B]
    in_prefix = pos < pre.unsqueeze(1)  # [B, S]
    # window query w (request position prefix + w) sees the prefix, and with "all" the window up to itself
    last = pre[:, None] + (torch.arange(cfg.window, device=dev) if cfg.softmax_over == "all" else -1)  # [B, W]
    visible = valid.unsqueeze(1) & (pos <= last.unsqueeze(-1))  # [B, W, S]
    probs = torch.softmax(logits.masked_fill(~visible[:, None, None], float("-inf")), dim=-1)
    votes = probs.sum(dim=3).masked_fill(~in_prefix[:, None, None], 0.0)  # [B, Hkv, G, S]
    pooled = _pool(votes.sum(dim=2), cfg) if cfg.group_sum == "before_pool" else _pool(votes, cfg).sum(dim=2)
    pooled = pooled.masked_fill(~in_prefix.unsqueeze(1), float("-inf"))  # [B, Hkv, S]
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
