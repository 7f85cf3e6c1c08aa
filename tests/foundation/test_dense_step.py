"""``Engine.begin_step(..., dense=True)``: the step's selectors keep their state (``on_append``) but
choose nothing, so every row attends densely (the verify pass of lossless decoding)."""
from __future__ import annotations

import torch

from kvsieve import Engine, KVCacheManager, KVCacheSpec, SparseAttention, SparseAttentionConfig, lower_config


def _engine(selector: str | None) -> tuple[Engine, SparseAttention]:
    spec = KVCacheSpec(num_layers=1, num_blocks=32, tokens_per_block=16, num_kv_heads=2, head_dim=16)
    config = None if selector is None else SparseAttentionConfig(selector, {"budget": 16, "page_size": 16})
    (plan,) = lower_config(config, num_layers=1)
    layer = SparseAttention(layer_idx=0, num_q_heads=4, num_kv_heads=2, head_dim=16, plan=plan)
    return Engine(KVCacheManager(spec), [layer], max_num_requests=2, max_num_tokens=256), layer


def _qkv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, 16, generator=g), torch.randn(n, 2, 16, generator=g), torch.randn(n, 2, 16, generator=g)


def _step(engine: Engine, layer: SparseAttention, n: int, seed: int, *, context: bool, dense: bool = False):
    md = engine.begin_step([0], [n], 1 if context else 0, dense=dense)
    out = layer.forward(*_qkv(n, seed), md)
    engine.end_step()
    return out


def test_a_dense_step_selects_nothing_and_attends_like_a_dense_layer_while_the_summaries_follow() -> None:
    quest, q_layer = _engine("quest")
    plain, p_layer = _engine(None)
    for engine, layer in ((quest, q_layer), (plain, p_layer)):
        _step(engine, layer, 100, 0, context=True)
    sparse = _step(quest, q_layer, 1, 1, context=False)
    assert sparse.params is not None and sparse.stats.attended < sparse.stats.dense  # quest selects at decode
    _step(plain, p_layer, 1, 1, context=False)
    verify, reference = (_step(e, layer, 3, 2, context=False, dense=True) for e, layer in ((quest, q_layer),
                                                                                         (plain, p_layer)))
    assert verify.params is None and verify.stats.attended == verify.stats.dense
    assert torch.allclose(verify.out, reference.out, atol=1e-6)  # the same K/V: dense attention
    (pool,) = quest.cache.aux_pools.values()
    summaries = pool[0][quest.cache.block_ids(0)]  # [blocks, Hkv, pages, 2, D]: the page holding 101..103
    keys = quest.cache.k_cache(0)[quest.cache.block_ids(0)[-1], :, : 104 % 16].float()  # [Hkv, n, D]
    assert torch.equal(summaries[-1, :, 0, 0].float(), keys.amin(1).bfloat16().float())
    assert torch.equal(summaries[-1, :, 0, 1].float(), keys.amax(1).bfloat16().float())
