"""streaming and oracle_topk: what they select, that they sparsify, and oracle recall."""
from __future__ import annotations

import pytest
import torch

from kvsieve import Engine, KVCacheManager, KVCacheSpec, SparseAttention, SparseAttentionConfig, lower_config
from kvsieve.selectors.oracle_topk.selector import attention_mass
from kvsieve.selectors.streaming.selector import streaming_topk
from kvsieve.sparse.backends.vanilla import masked_attention
from kvsieve.sparse.selection import selection_mask


def run(selector, params, L=64, hq=4, hkv=2, d=16, kind="gqa", seed=0):
    torch.manual_seed(seed)
    rank = d - 4 if kind == "mla" else 0
    spec = KVCacheSpec(num_layers=1, num_blocks=80, tokens_per_block=8, num_kv_heads=hkv, head_dim=d, kind=kind,
                       kv_lora_rank=rank, rope_dim=4 if kind == "mla" else 0, max_requests=4, max_blocks_per_seq=20)
    plan = lower_config(SparseAttentionConfig(selector, params), num_layers=1, attention_kind=kind)[0]
    layer = SparseAttention(layer_idx=0, num_q_heads=hq, num_kv_heads=hkv if kind == "gqa" else 1, head_dim=d,
                            plan=plan, kind=kind, kv_lora_rank=rank)
    eng = Engine(KVCacheManager(spec), [layer], max_num_requests=4, max_num_tokens=256)
    return eng, layer


def test_streaming_topk_selects_sinks_and_window():
    sel = streaming_topk(torch.tensor([3, 10, 20, 8, 0]), budget=8, num_sink=2)
    assert sel[0].tolist() == [0, 1, 2, -1, -1, -1, -1, -1]  # every position, padding last
    assert sel[3].tolist() == list(range(8)) and sel[4].tolist() == [-1] * 8
    assert sel[1].tolist() == [0, 1, 4, 5, 6, 7, 8, 9]
    assert sel[2].tolist() == [0, 1, 14, 15, 16, 17, 18, 19]


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_streaming_sparsifies_and_matches_masked_golden(kind):
    eng, layer = run("streaming", {"budget": 12, "num_sink": 4}, kind=kind)
    hkv = 2 if kind == "gqa" else 1
    L, d = 40, 16
    q = torch.randn(L, 4, d)
    k = torch.randn(L, hkv, d) if kind == "gqa" else torch.randn(L, d)
    v = torch.randn(L, hkv, d) if kind == "gqa" else None
    (res,) = eng.step([0], [L], 1, [(q, k, v)])
    out, lse = res.out, res.lse
    lens = torch.arange(1, L + 1)
    assert res.stats.attended == hkv * int(torch.clamp(lens, max=12).sum())
    assert res.stats.attended_fraction == pytest.approx(414 / 820)  # sum(min(l, 12)) / sum(l)
    mask = selection_mask(res.params, slice(0, L), lens.to(torch.int32), L, hkv)
    kk = k if kind == "gqa" else k.unsqueeze(1)
    vv = v if kind == "gqa" else k[:, :12].unsqueeze(1)
    ref, ref_lse = masked_attention(q, kk, vv, mask, layer.geometry.sm_scale)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 4])
def test_oracle_topk_is_exact_and_finds_the_needle(block_size):
    eng, layer = run("oracle_topk", {"budget": 8, "block_size": block_size})
    L, d = 64, 16
    k, v = torch.randn(L, 2, d), torch.randn(L, 2, d)
    needle = 21
    k[needle] = 3 * torch.randn(2, d)
    eng.step([0], [L], 1, [(torch.randn(L, 4, d), k, v)])
    q = 0.6 * k[needle].repeat_interleave(2, 0).unsqueeze(0) + 0.1 * torch.randn(1, 4, d)
    (res,) = eng.step([0], [1], 0, [(q, torch.randn(1, 2, d), torch.randn(1, 2, d))])
    sel = res.params.sparse_attn_indices
    assert all(needle // block_size in sel[h].tolist() for h in range(2))
    # exactness: the selection is the top-k of the true per-group attention mass
    keys = eng.cache.gather(0, 0)[0]
    mass = attention_mass(q, keys, torch.tensor([L + 1]), layer.geometry.sm_scale)[0]  # [Hkv, L+1]
    if block_size > 1:
        mass = torch.nn.functional.pad(mass, (0, 3)).view(2, -1, block_size).sum(-1)
    expect = mass.topk(8 // block_size, dim=-1).indices.sort(-1).values
    assert sel.tolist() == expect.tolist()
    assert res.stats.attended <= 2 * 8
    # oracle recall of the attention mass is at least the recall of any other selection of equal size
    recall = mass.gather(1, sel.long()).sum() / mass.sum()
    other = mass[:, -8 // block_size:].sum() / mass.sum()
    assert recall >= other
