"""A small step driver (the engine role: ledger, metadata, layers, evictions) used by tests, the demo and eval.

``begin_step`` commits the step's tokens to the ledger, fills :class:`AttentionMetadata` and runs
``prepare()``; the caller then runs its layers; ``end_step`` commits evictions. ``step`` does all
three for callers whose per-layer inputs are known up front.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..metadata import AttentionMetadata, KVCacheManager
from .attention import LayerOutput, SparseAttention, commit_evictions

__all__ = ["Engine"]


class Engine:
    """Owns the metadata of a stack of :class:`SparseAttention` layers sharing one KV cache."""

    def __init__(self, cache: KVCacheManager, layers: Sequence[SparseAttention], *, max_num_requests: int,
                 max_num_tokens: int, translations: Sequence[str] | None = None) -> None:
        needed = sorted({t for layer in layers for t in layer.backend.required_translations})
        self.cache = cache
        self.layers = list(layers)
        self.metadata = AttentionMetadata(kv_cache_manager=cache, max_num_requests=max_num_requests,
                                          max_num_tokens=max_num_tokens,
                                          translations=translations if translations is not None else needed)

    def begin_step(self, request_ids: Sequence[int], seq_lens: Sequence[int], num_contexts: int) -> AttentionMetadata:
        """Context requests first. A request id not yet in the cache is added."""
        if len(request_ids) != len(seq_lens):
            raise ValueError("request_ids and seq_lens must have the same length")
        for rid, n in zip(request_ids, seq_lens):
            if rid not in self.cache.request_ids:
                self.cache.add_request(rid)
            self.cache.append_tokens(rid, int(n))
        md = self.metadata
        md.request_ids = list(request_ids)
        md.seq_lens = list(seq_lens)
        md.num_contexts = num_contexts
        md.prepare()
        return md

    def end_step(self) -> dict[int, int]:
        """Commit evictions recorded by the layers; returns request id -> kept length."""
        return commit_evictions(self.metadata)

    def step(self, request_ids: Sequence[int], seq_lens: Sequence[int], num_contexts: int,
             layer_inputs: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
             ) -> list[LayerOutput]:
        if len(layer_inputs) != len(self.layers):
            raise ValueError(f"expected inputs for {len(self.layers)} layers, got {len(layer_inputs)}")
        md = self.begin_step(request_ids, seq_lens, num_contexts)
        outs = [layer.forward(q, k, v, md) for layer, (q, k, v) in zip(self.layers, layer_inputs)]
        self.end_step()
        return outs

    def free(self, request_id: int) -> None:
        self.cache.free_request(request_id)
