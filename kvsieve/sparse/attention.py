"""``SparseAttention``: one layer of DESIGN.md section 2 — append, predict, attend, compact.

Order within ``forward`` for one step:

1. write the step's K/V into the paged cache;
2. ``selector.on_append`` (e.g. page summaries);
3. context phase: ``selector.predict_kv`` picks the prompt tokens to keep;
4. ``selector.predict_attn`` picks what each query attends (or gives kernel hints);
5. the backend computes attention over exactly that set;
6. if tokens were evicted, this layer's pool is compacted in place *after* the attention (the
   prompt's own causal attention still sees the whole prompt, as in RocketKV/SnapKV), and the
   new per-request length is recorded in :attr:`AttentionMetadata` for the engine to commit once
   every layer is done (:func:`commit_evictions`), because the ledger length is shared by layers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..metadata import AttentionMetadata
from .algorithm import SelectorInputs
from .backends import AttentionBackend, AttentionGeometry, default_backend, get_backend
from .config import LayerPlan
from .params import SparseRuntimeParams

__all__ = ["SparseAttention", "LayerStats", "commit_evictions"]


@dataclass(frozen=True)
class LayerStats:
    """What the last forward really did: attended vs. dense positions (summed over tokens x KV heads)."""

    attended: int
    dense: int
    kept_after_eviction: int | None = None
    skipped_tiles: int = 0
    walked_tiles: int = 0

    @property
    def attended_fraction(self) -> float:
        return self.attended / self.dense if self.dense else 1.0

    @property
    def computed_fraction(self) -> float:
        """Fraction of attended positions whose softmax and P.V ran (skip-softmax skips tiles)."""
        skipped = self.skipped_tiles / self.walked_tiles if self.walked_tiles else 0.0
        return self.attended_fraction * (1.0 - skipped)


class SparseAttention:
    """Runs one layer's selector then backend. GQA: q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``;
    MLA (absorbed): q ``[T, H, R+P]``, k = latent ``[T, R+P]``, v ``None``; returns
    ``(out [T, Hq, Dv], lse [T, Hq])``."""

    def __init__(self, *, layer_idx: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 plan: LayerPlan | None = None, backend: AttentionBackend | str | None = None, kind: str = "gqa",
                 kv_lora_rank: int = 0, sm_scale: float | None = None, debug: bool = True,
                 device: str | torch.device = "cpu") -> None:
        self.layer_idx = layer_idx
        self.geometry = AttentionGeometry(
            kind=kind, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            sm_scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim), kv_lora_rank=kv_lora_rank,
        )
        self.plan = plan
        if backend is None:
            backend = default_backend(device)
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.debug = debug
        self.last_params: SparseRuntimeParams | None = None
        self.last_stats: LayerStats | None = None
        if plan is not None:
            plan.selector.check_support(attention_kind=kind)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if not metadata.prepared:
            raise RuntimeError("AttentionMetadata.prepare() must run before forward")
        missing = [t for t in self.backend.required_translations if t not in metadata.translations]
        if missing:
            raise ValueError(f"backend {self.backend.name!r} needs metadata translations {missing}")
        g = self.geometry
        if q.shape[0] != metadata.num_tokens or q.shape[1] != g.num_q_heads:
            raise ValueError(f"q must be [num_tokens={metadata.num_tokens}, {g.num_q_heads}, D], got {tuple(q.shape)}")
        mgr = metadata.kv_cache_manager
        slots = metadata.slots[metadata.token_to_req_host]
        mgr.write(self.layer_idx, slots, metadata.positions_host, k, v)
        params = kept = None
        if self.plan is not None:
            inputs = SelectorInputs(q=q, k=k, v=v, metadata=metadata, layer_idx=self.layer_idx,
                                    num_kv_heads=g.num_kv_heads, sm_scale=g.sm_scale, attention_kind=g.kind)
            sel = self.plan.selector
            sel.on_append(inputs)
            if metadata.num_contexts and "context" in self.plan.phases:
                kept = sel.predict_kv(inputs)
            phase_ok = (metadata.num_generations and "generation" in self.plan.phases) or (
                metadata.num_contexts and "context" in self.plan.phases)
            params = sel.predict_attn(inputs) if phase_ok else None
            if kept is not None:
                params = _with_kept(params, kept)
            if params is not None and self.debug:
                prompt_lens = torch.as_tensor(metadata.kv_lens_host[: metadata.num_contexts])
                params.validate(num_kv_heads=g.num_kv_heads, num_query_tokens=metadata.num_tokens,
                                num_contexts=metadata.num_contexts, kv_lens=metadata.token_kv_lens,
                                prompt_lens=prompt_lens)
        out, lse = self.backend.forward(q, metadata, self.layer_idx, g, params)
        attended = self.backend.effective_attended_tokens(params, metadata, g)
        dense = metadata.token_kv_lens.to(torch.int64).sum() * g.num_kv_heads
        n_kept = None
        if kept is not None:
            n_kept = self._compact(metadata, inputs, *kept)
        self.last_params = params
        skipped, walked = getattr(self.backend, "last_skip_stats", (0, 0))
        self.last_stats = LayerStats(int(attended.sum()), int(dense), n_kept, skipped, walked)
        return out, lse

    def _compact(self, metadata: AttentionMetadata, inputs: SelectorInputs, indices: torch.Tensor,
                 offsets: torch.Tensor) -> int:
        mgr = metadata.kv_cache_manager
        off = offsets.tolist()
        kept_per_req = []
        for i in range(metadata.num_contexts):
            rid = metadata.request_ids[i]
            sel = indices[:, off[i]: off[i + 1]]
            mgr.compact(self.layer_idx, rid, sel)
            kept_per_req.append(sel)
            prev = metadata.pending_kv_lens.setdefault(rid, sel.shape[1])
            if prev != sel.shape[1]:
                raise ValueError(f"request {rid}: layer {self.layer_idx} keeps {sel.shape[1]} tokens but an "
                                 f"earlier layer kept {prev}; all layers must keep the same number")
        self.plan.selector.on_compacted(inputs, kept_per_req)
        return sum(s.shape[1] for s in kept_per_req)


def _with_kept(params: SparseRuntimeParams | None, kept: tuple[torch.Tensor, torch.Tensor]) -> SparseRuntimeParams:
    base = params if params is not None else SparseRuntimeParams()
    return replace(base, sparse_kv_indices=kept[0], sparse_kv_offsets=kept[1])


def commit_evictions(metadata: AttentionMetadata) -> dict[int, int]:
    """After every layer ran: truncate the ledger of each evicted request to its kept length."""
    done = dict(metadata.pending_kv_lens)
    for rid, n in done.items():
        metadata.kv_cache_manager.truncate(rid, n)
    metadata.pending_kv_lens.clear()
    return done
