"""Selection shapes that used to go silently wrong: block-granular MLA on the Triton backend, and
several query tokens of one request in one decode step (Quest, RocketKV)."""
from __future__ import annotations

import pytest
import torch

from kvsieve import Engine, KVCacheManager, KVCacheSpec, SparseAttention, lower_config
from kvsieve.sparse import SparseAttentionConfig
from kvsieve.sparse.selection import attended_counts


def mla_engine(backend: str, selector: str | None, params: dict, *, rank: int = 32, rope: int = 8, tpb: int = 8,
               heads: int = 4) -> Engine:
    spec = KVCacheSpec(num_layers=1, num_blocks=32, tokens_per_block=tpb, kind="mla", kv_lora_rank=rank,
                       rope_dim=rope, max_requests=4, max_blocks_per_seq=16)
    cfg = None if selector is None else SparseAttentionConfig(selector, params)
    plan = lower_config(cfg, num_layers=1, attention_kind="mla")[0]
    layer = SparseAttention(layer_idx=0, num_q_heads=heads, num_kv_heads=1, head_dim=rank + rope, plan=plan,
                            backend=backend, kind="mla", kv_lora_rank=rank)
    return Engine(KVCacheManager(spec), [layer], max_num_requests=4, max_num_tokens=128)


def mla_inputs(n: int, seed: int, heads: int = 4, dim: int = 40):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, heads, dim, generator=g), torch.randn(n, dim, generator=g), None)]


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_triton_mla_block_granular_selection_matches_vanilla(block_size):
    params = {"budget": 3 * block_size, "block_size": block_size}
    engines = {b: mla_engine(b, "oracle_topk", params) for b in ("vanilla", "triton")}
    for i, (rids, lens, nctx) in enumerate([([1, 2], [21, 14], 2), ([3, 1, 2], [9, 1, 3], 1)]):
        inputs = mla_inputs(sum(lens), seed=i)
        want = engines["vanilla"].step(rids, lens, nctx, inputs)[0]
        got = engines["triton"].step(rids, lens, nctx, inputs)[0]
        torch.testing.assert_close(got.out, want.out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.lse, want.lse, rtol=1e-4, atol=1e-4)
        md = engines["triton"].metadata
        pages = attended_counts(got.params, md.token_kv_lens, 1, md.kv_cache_manager.tokens_per_block)
        assert got.stats.attended == int(pages.sum())


def _selected(params, t: int, hkv: int) -> list[set[int]]:
    idx, off = params.sparse_attn_indices, params.sparse_attn_offsets
    return [{int(x) for x in idx[h, off[t]: off[t + 1]] if x >= 0} for h in range(hkv)]


@pytest.mark.parametrize("selector, params", [
    ("quest", {"budget": 8, "page_size": 4, "summary_dtype": "float32"}),
    ("quest", {"budget": 12, "page_size": 2, "summary_dtype": "bfloat16"}),
    ("rocketkv", {"window_size": 4, "kernel_size": 3, "prompt_budget": 16, "page_size": 4, "topk": 2,
                  "summary_dtype": "float32"}),
])
def test_k_decode_tokens_in_one_step_select_what_k_single_steps_select(selector, params):
    """Tokens 2..k of the step sit in the same page as token 1 (and in the next one): with step-wide
    summaries token 1 would see their keys."""
    from .rig import make_rig

    k = 5
    rigs = [make_rig(selector, params, num_layers=1, num_blocks=40, max_blocks_per_seq=16) for _ in range(2)]
    prompt = rigs[0].inputs(22, seed=0)
    for rig in rigs:
        rig.engine.step([1], [22], 1, prompt)
    q, kk, v = rigs[0].inputs(k, seed=1)[0]
    scale = torch.linspace(1, 4, k)[:, None, None]  # later keys larger: they would dominate a shared summary
    kk = kk * scale
    multi = rigs[0].engine.step([1], [k], 0, [(q, kk, v)])[0]
    multi_params = multi.params
    for j in range(k):
        single = rigs[1].engine.step([1], [1], 0, [(q[j: j + 1], kk[j: j + 1], v[j: j + 1])])[0]
        single_params = single.params
        assert _selected(multi_params, j, 2) == _selected(single_params, 0, 2), f"token {j}"
        torch.testing.assert_close(multi.out[j: j + 1], single.out, rtol=1e-5, atol=1e-5)
