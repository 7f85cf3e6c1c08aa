"""A small multi-layer engine over a paged cache, and exact snapshots of its state to compare."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvsieve import Engine, KVCacheManager, KVCacheSpec, SparseAttention, lower_config
from kvsieve.sparse import SparseAttentionConfig


@dataclass
class Rig:
    engine: Engine
    cache: KVCacheManager
    hkv: int
    g: int
    d: int

    def inputs(self, n: int, seed: int, dtype=torch.float32):
        gen = torch.Generator().manual_seed(seed)
        return [(torch.randn(n, self.hkv * self.g, self.d, generator=gen).to(dtype),
                 torch.randn(n, self.hkv, self.d, generator=gen).to(dtype),
                 torch.randn(n, self.hkv, self.d, generator=gen).to(dtype)) for _ in self.engine.layers]


def make_rig(selector: str | None = None, params: dict | None = None, *, num_layers: int = 2, tpb: int = 4,
             num_blocks: int = 16, max_requests: int = 4, max_blocks_per_seq: int = 8, max_tokens: int = 64,
             max_num_requests: int = 4, hkv: int = 2, g: int = 2, d: int = 8, backend: str = "vanilla") -> Rig:
    spec = KVCacheSpec(num_layers=num_layers, num_blocks=num_blocks, tokens_per_block=tpb, num_kv_heads=hkv,
                       head_dim=d, max_requests=max_requests, max_blocks_per_seq=max_blocks_per_seq)
    cache = KVCacheManager(spec)
    cfg = None if selector is None else SparseAttentionConfig(selector, params or {})
    layers = [SparseAttention(layer_idx=i, num_q_heads=hkv * g, num_kv_heads=hkv, head_dim=d, plan=p, backend=backend)
              for i, p in enumerate(lower_config(cfg, num_layers=num_layers))]
    engine = Engine(cache, layers, max_num_requests=max_num_requests, max_num_tokens=max_tokens)
    return Rig(engine, cache, hkv, g, d)


def state(cache: KVCacheManager) -> dict:
    """Everything a step may change: ledger arrays, slot maps, the allocator (free list, LRU,
    reference counts, names), the token records, every pool."""
    return {
        "block_table": cache.block_table.copy(), "num_blocks_of": cache.num_blocks_of.copy(),
        "valid_lens": cache.valid_lens.copy(), "addressable_lens": cache.addressable_lens.copy(),
        "copied_from": cache.copied_from.copy(), "slot_of": dict(cache._slot_of), "free_slots": list(cache._free_slots),
        "free_blocks": list(cache.allocator._free), "evictable": list(cache.allocator._evictable),
        "refcount": cache.allocator.refcount.copy(), "hash_of": dict(cache.allocator._hash_of),
        "tokens": [None if t is None else list(t) for t in cache._tokens], "hashes": [list(h) for h in cache._hashes],
        "pools": [p.clone() for p in cache.pools],
        "aux": {k: [p.clone() for p in v] for k, v in cache.aux_pools.items()},
    }


def assert_same_state(before: dict, after: dict) -> None:
    for key in ("block_table", "num_blocks_of", "valid_lens", "addressable_lens", "copied_from", "refcount"):
        np.testing.assert_array_equal(before[key], after[key], err_msg=key)
    for key in ("slot_of", "free_slots", "free_blocks", "evictable", "hash_of", "tokens", "hashes"):
        assert before[key] == after[key], key
    for i, (a, b) in enumerate(zip(before["pools"], after["pools"])):
        assert torch.equal(a, b), f"pool of layer {i} changed"
    for name, pools in before["aux"].items():
        for i, (a, b) in enumerate(zip(pools, after["aux"][name])):
            assert torch.equal(a, b), f"aux pool {name} layer {i} changed"
    for name, pools in after["aux"].items():  # registered during the failed step: back to zeros
        if name not in before["aux"]:
            assert all(not p.any() for p in pools), f"new aux pool {name} not zeroed"


def records(engine: Engine) -> list[tuple[frozenset[int], np.ndarray | None]]:
    """Each layer's record of the requests and blocks its selector has seen, as plain values."""
    out = []
    for layer in engine.layers:
        r = layer.record()
        out.append((r.attached, None if r.seen_blocks is None else r.seen_blocks.copy()))
    return out


def assert_same_records(before: list, after: list) -> None:
    for i, ((att_a, seen_a), (att_b, seen_b)) in enumerate(zip(before, after)):
        assert att_a == att_b, f"layer {i}: attached requests changed"
        assert (seen_a is None) == (seen_b is None), f"layer {i}: seen blocks changed"
        if seen_a is not None:
            np.testing.assert_array_equal(seen_a, seen_b, err_msg=f"layer {i}: seen blocks")
