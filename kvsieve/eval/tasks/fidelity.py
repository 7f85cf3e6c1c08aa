"""Attention fidelity on real Q/K/V: an essay prefix is prefilled densely, then the last
``num_queries`` tokens of the text are decoded teacher-forced with the selector active. For each
decode step and layer, the sparse output is compared with dense attention on the *same* q and
cache (mass recall, relative output error, top-k overlap with the oracle); the next-token logits
are compared with the dense run's (KL). Score = mean attention-mass recall over the layers the
selector ran on (a dense layer, or a windowed layer the plan leaves to its window, reads what
dense attention reads and would pull the mean towards 1); ``mass_recall_per_layer`` gives every
layer's mean over the decode steps (``1`` on a dense layer), joined by ``|``.

The inputs of layer ``l`` come from the sparse trajectory (errors of earlier layers propagate into
them); the KL measures the end-to-end effect. For an evicting selector the per-layer reference is
the retained cache, so only its KL sees what eviction lost.
"""
from __future__ import annotations

import random
from typing import Any

import torch

from ...integrations.transformers import KvsieveSession, gather_request_kv
from ...metadata import AttentionMetadata
from ...sparse import LayerOutput, SparseAttention
from ...sparse.selection import selection_mask
from ..haystack import essay_haystack
from ..metrics import fidelity_metrics, kl_divergence
from .base import Sample, Task, register_task

__all__ = ["FidelityTask"]


@register_task
class FidelityTask(Task):
    """Sparse vs dense attention on the same real q and cache while decoding an essay's last tokens."""

    name = "fidelity"
    kind = "fidelity"
    needs_reference = True
    metric = "attention-mass recall"
    uses_depths = False
    num_queries = 8

    def make_one(self, tokenizer: Any, length: int, depth: float | None, rng: random.Random, index: int) -> Sample:
        return Sample(index, essay_haystack(tokenizer, length, start=rng.randrange(1000)), [], None, {})

    def prefix_len(self, num_ids: int) -> int:
        if num_ids <= self.num_queries:
            raise ValueError(f"fidelity: the prompt needs more than num_queries={self.num_queries} tokens")
        return num_ids - self.num_queries

    def run(self, session: KvsieveSession, logits: torch.Tensor, ids: torch.Tensor, sample: Sample,
            reference: Any, tokenizer: Any) -> dict[str, Any]:
        """Teacher-forced decode of ``ids[:, prefix:]``; ``reference``: the dense run's logits (or ``None``)."""
        per_layer: list[tuple[int, dict[str, float] | None]] = []  # (layer, metrics; None = dense layer)

        def observe(layer_idx: int, q: torch.Tensor, result: LayerOutput, md: AttentionMetadata,
                    layer: SparseAttention) -> None:
            params, out = result.params, result.out
            if params is None:
                per_layer.append((layer_idx, None))
                return
            k, v = gather_request_kv(md.kv_cache_manager, layer_idx, md.request_ids[0])
            g = layer.geometry
            mask = selection_mask(params if params.selects_positions("generation") else None, slice(0, q.shape[0]),
                                  md.token_kv_lens, k.shape[0], g.num_kv_heads)
            per_layer.append((layer_idx, fidelity_metrics(q, k, v, mask, out, g.sm_scale)))

        start = self.prefix_len(ids.shape[1])
        steps = []
        session.observers.append(observe)
        try:
            for i in range(start, ids.shape[1]):
                steps.append(session.decode(ids[:, i]))
        finally:
            session.observers.remove(observe)
        logits_seq = torch.cat(steps, dim=0)  # [num_queries, V]
        row = _layer_means(per_layer)
        row["kl"] = 0.0 if reference is None else kl_divergence(reference, logits_seq)
        row["score"] = row["mass_recall"]
        row["_reference"] = logits_seq
        return row


_DENSE_LAYER = {"mass_recall": 1.0, "rel_error": 0.0, "topk_overlap": 1.0}


def _layer_means(per_layer: list[tuple[int, dict[str, float] | None]]) -> dict[str, Any]:
    """Means over the (layer, step) entries of the selected layers (a run with none selected
    scores as dense), and ``mass_recall_per_layer``: each layer's mean recall, ``|``-joined in
    layer order."""
    selected = [m for _, m in per_layer if m is not None]
    row: dict[str, Any] = {key: sum(m[key] for m in selected) / len(selected) if selected else dense
                           for key, dense in _DENSE_LAYER.items()}
    by_layer: dict[int, list[float]] = {}
    for layer_idx, m in per_layer:
        by_layer.setdefault(layer_idx, []).append((m or _DENSE_LAYER)["mass_recall"])
    row["mass_recall_per_layer"] = "|".join(f"{sum(v) / len(v):.4f}" for _, v in sorted(by_layer.items()))
    return row
