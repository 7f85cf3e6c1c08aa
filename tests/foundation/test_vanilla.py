"""The Vanilla golden against torch SDPA (nothing selected away) and a direct masked computation."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvsieve import Engine, KVCacheManager, KVCacheSpec, SparseAttention, SparseRuntimeParams
from kvsieve.sparse.backends.vanilla import VanillaBackend


def engine(hq, hkv, d, page=5, kind="gqa", rank=0, layout="HND"):
    spec = KVCacheSpec(num_layers=1, num_blocks=200, tokens_per_block=page, num_kv_heads=hkv, head_dim=d,
                       kind=kind, kv_lora_rank=rank, rope_dim=d - rank if kind == "mla" else 0, layout=layout,
                       max_requests=8, max_blocks_per_seq=60)
    layer = SparseAttention(layer_idx=0, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, kind=kind, kv_lora_rank=rank,
                            backend="vanilla")
    return Engine(KVCacheManager(spec), [layer], max_num_requests=8, max_num_tokens=512)


def sdpa(q, k, v, causal_offset):
    """q [n,Hq,D], k/v [L,Hkv,D]; query i sits at position causal_offset + i."""
    n, L = q.shape[0], k.shape[0]
    mask = torch.arange(L)[None, :] <= (causal_offset + torch.arange(n))[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          attn_mask=mask, enable_gqa=True).transpose(0, 1)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_dense_gqa_equals_sdpa_prefill_and_decode(group, layout):
    torch.manual_seed(group)
    hkv, d = 2, 16
    hq = hkv * group
    eng = engine(hq, hkv, d, layout=layout)
    lens = [13, 7, 30]
    qs = [torch.randn(n, hq, d) for n in lens]
    ks = [torch.randn(n, hkv, d) for n in lens]
    vs = [torch.randn(n, hkv, d) for n in lens]
    (res,) = eng.step([1, 2, 3], lens, 3, [(torch.cat(qs), torch.cat(ks), torch.cat(vs))])
    out, lse = res.out, res.lse
    off = np.cumsum([0, *lens])
    for i in range(3):
        ref = sdpa(qs[i], ks[i], vs[i], 0)
        torch.testing.assert_close(out[off[i]: off[i + 1]], ref, rtol=1e-5, atol=1e-5)
    # decode step: each request one more token
    q1, k1, v1 = torch.randn(3, hq, d), torch.randn(3, hkv, d), torch.randn(3, hkv, d)
    (res,) = eng.step([1, 2, 3], [1, 1, 1], 0, [(q1, k1, v1)])
    out, lse = res.out, res.lse
    for i in range(3):
        kk, vv = torch.cat([ks[i], k1[i:i + 1]]), torch.cat([vs[i], v1[i:i + 1]])
        torch.testing.assert_close(out[i:i + 1], sdpa(q1[i:i + 1], kk, vv, lens[i]), rtol=1e-5, atol=1e-5)
        s = torch.einsum("hgd,lhd->hgl", q1[i].view(hkv, group, d), kk) / d ** 0.5
        torch.testing.assert_close(lse[i], torch.logsumexp(s, -1).reshape(hq), rtol=1e-5, atol=1e-5)


def test_dense_mla_equals_sdpa():
    torch.manual_seed(0)
    h, rank, rope = 16, 24, 8
    eng = engine(h, 1, rank + rope, kind="mla", rank=rank)
    n = 21
    q, lat = torch.randn(n, h, rank + rope), torch.randn(n, rank + rope)
    (res,) = eng.step([4], [n], 1, [(q, lat, None)])
    out, _ = res.out, res.lse
    ref = sdpa(q, lat.unsqueeze(1), lat[:, :rank].unsqueeze(1), 0)
    assert out.shape == (n, h, rank)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 4])
def test_selection_equals_direct_masked_computation(block_size):
    torch.manual_seed(block_size)
    hq, hkv, d, L = 4, 2, 8, 19
    eng = engine(hq, hkv, d)
    k, v = torch.randn(L, hkv, d), torch.randn(L, hkv, d)
    eng.step([0], [L], 1, [(torch.randn(L, hq, d), k, v)])
    md = eng.begin_step([0], [1], 0)
    q = torch.randn(1, hq, d)
    k1, v1 = torch.randn(1, hkv, d), torch.randn(1, hkv, d)
    sel = torch.tensor([[[0, 3, -1]], [[2, 4, 1]]], dtype=torch.int32).permute(1, 0, 2)  # [T=1, Hkv, 3]
    params = SparseRuntimeParams.from_topk(sel, block_size=block_size)
    eng.cache.write(0, md.slots, md.positions_host, k1, v1)
    res = VanillaBackend().forward(q, md, 0, eng.layers[0].geometry, params)
    out, lse = res.out, res.lse
    kk, vv = torch.cat([k, k1]), torch.cat([v, v1])
    for h in range(hkv):
        chosen = sorted({p for b in sel[0, h].tolist() if b >= 0
                         for p in range(b * block_size, min((b + 1) * block_size, L + 1))})
        for g in range(hq // hkv):
            qh = q[0, h * (hq // hkv) + g]
            s = kk[chosen, h] @ qh / d ** 0.5
            ref = torch.softmax(s, 0) @ vv[chosen, h]
            torch.testing.assert_close(out[0, h * (hq // hkv) + g], ref, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(lse[0, h * (hq // hkv) + g], torch.logsumexp(s, 0), rtol=1e-5, atol=1e-6)


def test_empty_selection_gives_zero_and_inf_lse():
    hq, hkv, d = 2, 1, 8
    eng = engine(hq, hkv, d)
    eng.step([0], [6], 1, [(torch.randn(6, hq, d), torch.randn(6, hkv, d), torch.randn(6, hkv, d))])
    md = eng.begin_step([0], [1], 0)
    params = SparseRuntimeParams.from_topk(torch.full((1, 1, 2), -1, dtype=torch.int32))
    res = VanillaBackend().forward(torch.randn(1, hq, d), md, 0, eng.layers[0].geometry, params)
    out, lse = res.out, res.lse
    assert torch.count_nonzero(out) == 0 and bool(torch.isposinf(lse).all())
