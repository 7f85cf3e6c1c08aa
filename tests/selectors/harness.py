"""Test harness: one-layer Engine over a paged cache, and hooks driven without the layer."""
from __future__ import annotations

import torch

from kvsieve import Engine, KVCacheManager, KVCacheSpec, SelectorInputs, SparseAttention, lower_config
from kvsieve.sparse import SparseAttentionConfig, selection_mask
from kvsieve.sparse.selector_step import place_rows
from kvsieve.sparse.backends.vanilla import masked_attention


class Harness:
    """``hkv`` KV heads, ``g`` query heads per KV head, ``d`` head dim, ``tpb`` tokens per block."""

    def __init__(self, selector: str | None, params: dict | None = None, *, hkv: int = 2, g: int = 2, d: int = 32,
                 tpb: int = 16, num_blocks: int = 2048, max_tokens: int = 8192, num_layers: int = 1,
                 backend: str = "vanilla", phases: tuple[str, ...] | None = None, window: int | None = None) -> None:
        spec = KVCacheSpec(num_layers=num_layers, num_blocks=num_blocks, tokens_per_block=tpb, num_kv_heads=hkv,
                           head_dim=d, max_requests=8, max_blocks_per_seq=1024)
        self.cache = KVCacheManager(spec)
        cfg = None if selector is None else SparseAttentionConfig(selector, params or {}, phases=phases)
        plans = lower_config(cfg, num_layers=num_layers)
        self.layers = [SparseAttention(layer_idx=i, num_q_heads=hkv * g, num_kv_heads=hkv, head_dim=d, plan=p,
                                       backend=backend, window=window)
                       for i, p in enumerate(plans)]
        self.engine = Engine(self.cache, self.layers, max_num_requests=8, max_num_tokens=max_tokens)
        self.hkv, self.g, self.d = hkv, g, d

    @property
    def selector(self):
        return self.layers[0].plan.selector

    def qkv(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (torch.randn(n, self.hkv * self.g, self.d, generator=gen),
                torch.randn(n, self.hkv, self.d, generator=gen), torch.randn(n, self.hkv, self.d, generator=gen))

    def hook_inputs(self, rids, seq_lens, num_contexts, q, k, v, layer_idx: int = 0,
                    model_inputs: object = None) -> SelectorInputs:
        """Begin a step and write K/V as the layer would, without running the layer; calls ``on_append``.
        ``model_inputs``: the step's per-layer model inputs, as ``SparseAttention.forward`` takes them."""
        md = self.engine.begin_step(rids, seq_lens, num_contexts)
        slots = md.slots[md.token_to_req_host[: md.num_tokens]]
        self.cache.write(layer_idx, slots, md.positions_host[: md.num_tokens], k, v)
        inputs = self.layers[layer_idx].selector_inputs(q, k, v, md, model_inputs)
        if self.layers[layer_idx].plan is not None:
            self.selector.on_append(inputs)
        return inputs


def reference_params(selector, inputs: SelectorInputs):
    """The selector's reference answer for ``inputs.rows``, placed in the step's rows as the layer does."""
    return place_rows(selector.predict_attn_naive(inputs), inputs, selector.name)


def expected_output(q, keys, values, params, md, rows: slice, kv_len: int, hkv: int, sm_scale: float,
                    phase: str | None = None):
    """Vanilla attention of ``q[rows]`` over ``keys``/``values [kv_len, Hkv, D]`` under ``params``'s mask
    (rows of ``phase``: dense unless ``params`` selects in it)."""
    if phase is not None and params is not None and not params.selects_positions(phase):
        params = None
    mask = selection_mask(params, rows, md.token_kv_lens, kv_len, hkv)
    return masked_attention(q[rows], keys, values, mask, sm_scale)


def selection_sets(params, num_tokens: int, hkv: int) -> list[list[set[int]]]:
    """``[token][head] -> set of selected units`` of an attention carrier (offsets cover ``num_tokens`` rows)."""
    idx, off = params.sparse_attn_indices, params.sparse_attn_offsets
    assert off.numel() == num_tokens + 1
    return [[{int(x) for x in idx[h, off[t]: off[t + 1]] if x >= 0} for h in range(hkv)] for t in range(num_tokens)]


def overlap(a, b) -> float:
    """Mean Jaccard-free overlap |a & b| / max(|a|, |b|) over (token, head) pairs."""
    vals = [len(x & y) / max(len(x), len(y)) if x or y else 1.0 for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(vals) / len(vals)
