"""The carrier between selectors and backends: ``SparseRuntimeParams``.

All index tensors are int32 and live on the KV cache's device. A step's query tokens are ordered
context (prefill) rows first, then generation (decode) rows (:attr:`AttentionMetadata.context_rows`,
:attr:`AttentionMetadata.generation_rows`).

* ``sparse_kv_indices [num_kv_heads, total_kept]`` with ``sparse_kv_offsets [num_contexts + 1]``:
  request-local prompt positions to keep, head-major; context request ``n`` and head ``h`` own
  ``sparse_kv_indices[h, off[n]:off[n+1]]``, sorted ascending (in-place compaction is safe).
* ``sparse_attn_indices [num_kv_heads, total_selected]`` with
  ``sparse_attn_offsets [num_query_tokens + 1]``: query token ``t`` and KV head ``h`` attend
  ``indices[h, off[t]:off[t+1]]``; entries are request-local token positions
  (``sparse_attn_indices_block_size == 1``) or block ids covering ``[i*B, (i+1)*B)``;
  ``-1`` marks padding; valid entries ascending and unique. Rows may have different lengths.
* ``selected_phases``: the phases whose rows read the attention indices; the rows of any other
  phase attend densely (causal) and own an empty segment.
* ``threshold_scale_factor_context`` / ``threshold_scale_factor_generation``: the skip-softmax
  factor of each phase (0 = off): a KV tile is skipped when every query row of it has
  ``exp(tile_max - running_max) < threshold_scale_factor / kv_len``.

Backends ask two questions per phase, :meth:`SparseRuntimeParams.selects_positions` and
:meth:`SparseRuntimeParams.threshold_scale_factor`; a phase for which both say "no" is dense.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..kernels.segment_check.plan import check_segments
from ..metadata import PHASES

__all__ = ["SparseRuntimeParams", "is_dense"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SparseRuntimeParams:
    """What one layer's selector decided for one step; consumed by every backend."""

    sparse_kv_indices: torch.Tensor | None = None
    sparse_kv_offsets: torch.Tensor | None = None
    sparse_attn_indices: torch.Tensor | None = None
    sparse_attn_offsets: torch.Tensor | None = None
    sparse_attn_indices_block_size: int = 1
    selected_phases: frozenset[str] = frozenset(PHASES)
    threshold_scale_factor_context: float = 0.0
    threshold_scale_factor_generation: float = 0.0

    @staticmethod
    def from_topk(topk: torch.Tensor, block_size: int = 1, **fields: Any) -> SparseRuntimeParams:
        """Pack a per-token selection ``topk [num_tokens, num_kv_heads, k]`` (``-1`` = none, any
        order, no duplicates among valid entries) into the head-major carrier: each segment is
        sorted ascending with the padding moved to its tail."""
        if topk.dim() != 3:
            raise ValueError(f"topk must be [num_tokens, num_kv_heads, k], got shape {tuple(topk.shape)}")
        t, h, k = topk.shape
        sel = SparseRuntimeParams.sort_padding_last(topk).to(torch.int32)
        indices = sel.permute(1, 0, 2).reshape(h, t * k).contiguous()
        offsets = torch.arange(0, (t + 1) * k, k, dtype=torch.int32, device=topk.device)
        return SparseRuntimeParams(sparse_attn_indices=indices, sparse_attn_offsets=offsets,
                                   sparse_attn_indices_block_size=block_size, **fields)

    @staticmethod
    def sort_padding_last(units: torch.Tensor) -> torch.Tensor:
        """``units [..., k]`` (integer, ``-1`` = padding) sorted ascending along the last dim with
        the padding moved to the tail of each segment; same shape and dtype. Units already in that
        order (a window selection, a merge's output) come back as they are after one comparison pass
        (a prompt's selection is millions of entries, where the sort costs several times the check)."""
        if _ascending_padding_last(units):
            return units
        big = torch.iinfo(torch.int64).max
        sel = units.to(torch.int64)
        sel = torch.where(sel < 0, big, sel).sort(dim=-1).values
        return torch.where(sel == big, -1, sel).to(units.dtype)

    def row_slice(self, rows: slice) -> SparseRuntimeParams:
        """The carrier cut to query rows ``[rows.start, rows.stop)``: their attention segments,
        offsets from 0; every other field unchanged. Requires attention indices."""
        if self.sparse_attn_indices is None or self.sparse_attn_offsets is None:
            raise ValueError("row_slice needs sparse_attn_indices and sparse_attn_offsets; this carrier has none")
        off = self.sparse_attn_offsets[rows.start: rows.stop + 1]
        a, b = int(off[0]), int(off[-1])
        return replace(self, sparse_attn_indices=self.sparse_attn_indices[:, a:b], sparse_attn_offsets=off - a)

    def selects_positions(self, phase: str) -> bool:
        """Whether rows of ``phase`` attend only their listed indices (else: dense causal)."""
        _check_phase(phase)
        return self.sparse_attn_indices is not None and phase in self.selected_phases

    def threshold_scale_factor(self, phase: str) -> float:
        """The skip-softmax factor of ``phase`` (0 = off)."""
        _check_phase(phase)
        return self.threshold_scale_factor_context if phase == "context" else self.threshold_scale_factor_generation


    def validate(
        self,
        *,
        num_kv_heads: int,
        num_query_tokens: int | None = None,
        num_contexts: int | None = None,
        kv_lens: torch.Tensor | None = None,
        prompt_lens: torch.Tensor | None = None,
    ) -> None:
        """Check dtype, shape, offsets, range and order; raise ``ValueError`` naming the field.

        ``kv_lens [num_query_tokens]`` (valid positions each query may see) enables the range
        check of attention indices; ``prompt_lens [num_contexts]`` that of the kept indices.
        """
        bs = self.sparse_attn_indices_block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ValueError(
                "sparse_attn_indices_block_size must be >= 1 (1 = token indices), got "
                f"{self.sparse_attn_indices_block_size}"
            )
        for phase in PHASES:
            value = self.threshold_scale_factor(phase)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                    and math.isfinite(value) and value >= 0):
                raise ValueError(f"threshold_scale_factor_{phase} must be a finite float >= 0 (0 = off), got {value!r}")
        if not self.selected_phases or not self.selected_phases <= set(PHASES):
            raise ValueError(f"selected_phases must be a non-empty subset of {list(PHASES)}, "
                             f"got {sorted(self.selected_phases)}")
        if (self.sparse_kv_indices is None) != (self.sparse_kv_offsets is None):
            raise ValueError("sparse_kv_indices and sparse_kv_offsets must be given together")
        if (self.sparse_attn_indices is None) != (self.sparse_attn_offsets is None):
            raise ValueError("sparse_attn_indices and sparse_attn_offsets must be given together")
        if self.sparse_kv_indices is not None:
            _check_pair(
                "sparse_kv", self.sparse_kv_indices, self.sparse_kv_offsets, num_kv_heads, num_contexts
            )
            check_segments("sparse_kv", self.sparse_kv_indices, self.sparse_kv_offsets, prompt_lens,
                           block_size=1, allow_padding=False)
        if self.sparse_attn_indices is not None:
            _check_pair(
                "sparse_attn", self.sparse_attn_indices, self.sparse_attn_offsets, num_kv_heads,
                num_query_tokens,
            )
            check_segments("sparse_attn", self.sparse_attn_indices, self.sparse_attn_offsets, kv_lens,
                           block_size=self.sparse_attn_indices_block_size, allow_padding=True)


def is_dense(params: SparseRuntimeParams | None, phase: str) -> bool:
    """True when ``params`` changes nothing for rows of ``phase``: no position selection and no
    skip-softmax (prompt-eviction indices alone do not change this step's attention)."""
    return params is None or not (params.selects_positions(phase) or params.threshold_scale_factor(phase) > 0)


def _check_phase(phase: str) -> None:
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {list(PHASES)}, got {phase!r}")


def _check_pair(
    prefix: str, indices: torch.Tensor, offsets: torch.Tensor, num_kv_heads: int, num_rows: int | None
) -> None:
    iname, oname = f"{prefix}_indices", f"{prefix}_offsets"
    if indices.dtype != torch.int32:
        raise ValueError(f"{iname} must be int32, got {indices.dtype}")
    if offsets.dtype != torch.int32:
        raise ValueError(f"{oname} must be int32, got {offsets.dtype}")
    if indices.dim() != 2 or indices.shape[0] != num_kv_heads:
        raise ValueError(
            f"{iname} must have shape [num_kv_heads={num_kv_heads}, total], got {tuple(indices.shape)}"
        )
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{oname} must be 1-D with at least one entry, got shape {tuple(offsets.shape)}")
    if num_rows is not None and offsets.numel() != num_rows + 1:
        raise ValueError(f"{oname} must have {num_rows + 1} entries (rows + 1), got {offsets.numel()}")
    if offsets.device != indices.device:
        raise ValueError(f"{oname} is on {offsets.device} but {iname} is on {indices.device}")


def _ascending_padding_last(units: torch.Tensor) -> bool:
    """Whether every segment of ``units [..., k]`` is strictly ascending valid entries followed by
    ``-1`` padding only (what :meth:`SparseRuntimeParams.sort_padding_last` returns)."""
    if units.shape[-1] < 2:
        return True
    for dim in range(units.dim() - 1):  # a broadcast dim (stride 0, e.g. one selection for every KV head): once
        if units.stride(dim) == 0:
            units = units.narrow(dim, 0, min(1, units.shape[dim]))
    a, b = units[..., :-1], units[..., 1:]
    return bool((units >= -1).all()) and bool(torch.where(a < 0, b == -1, (b > a) | (b == -1)).all())
