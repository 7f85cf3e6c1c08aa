"""Skip-softmax (BLASST): factor 0 is the dense path bit for bit; a skipping factor skips
tiles (stats), changes the output measurably, and matches the reference's tile walk exactly."""
from __future__ import annotations

import torch

from conftest import F32_TOL, make_block_table
from kvsieve.kernels.paged_prefill import naive as prefill_naive
from kvsieve.kernels.paged_prefill.triton import paged_prefill
from kvsieve.kernels.sparse_gqa_decode import naive
from kvsieve.kernels.sparse_gqa_decode.triton import sparse_gqa_decode
from kvsieve.kernels.sparse_mla_decode import naive as mla_naive
from kvsieve.kernels.sparse_mla_decode.triton import sparse_mla_decode


def _peaked(tokens=2, hkv=1, group=4, d=64, kv_len=256, page=16, seed=0):
    """Keys of the first 64 positions align with q (a logit gap of ~7 over the rest)."""
    g = torch.Generator().manual_seed(seed)
    bt = make_block_table(tokens, kv_len, page, tokens * (kv_len // page + 1) + 2, seed)
    nb = int(bt.max()) + 1
    q = torch.randn(tokens, hkv * group, d, generator=g)
    q = q / q.norm(dim=-1, keepdim=True) * 8
    k = torch.randn(nb, hkv, page, d, generator=g) * 0.1
    v = torch.randn(nb, hkv, page, d, generator=g)
    for t in range(tokens):
        for p in range(64):
            k[bt[t, p // page], :, p % page] += q[t].reshape(hkv, group, d).mean(1) * 3.0
    return (q, k, v, bt, torch.arange(tokens, dtype=torch.int32),
            torch.full((tokens,), kv_len, dtype=torch.int32))


def test_factor_zero_is_dense_exactly():
    q, k, v, bt, tok, kl = _peaked()
    st = torch.zeros(2, dtype=torch.int64)
    o0, l0 = sparse_gqa_decode(q, k, v, bt, tok, kl)
    o1, l1 = sparse_gqa_decode(q, k, v, bt, tok, kl, threshold_scale_factor=0.0, stats=st)
    assert torch.equal(o0, o1) and torch.equal(l0, l1)
    assert st[0] == 0 and st[1] == 2 * 4  # 2 tokens x 4 tiles of 64, nothing skipped


def test_decode_skips_and_matches_reference():
    q, k, v, bt, tok, kl = _peaked()
    dense, _ = sparse_gqa_decode(q, k, v, bt, tok, kl)
    for splits in (1, 2):
        st, rst = torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
        o, l = sparse_gqa_decode(q, k, v, bt, tok, kl, threshold_scale_factor=2.0, stats=st,
                                 num_splits=splits)
        ro, rl = naive.sparse_gqa_decode(q, k, v, bt, tok, kl, threshold_scale_factor=2.0,
                                         stats=rst, num_splits=splits)
        assert st.tolist() == rst.tolist()
        assert st[0] > 0
        torch.testing.assert_close(o, ro, **F32_TOL)
        torch.testing.assert_close(l, rl, **F32_TOL)
        assert (o - dense).abs().max() > 1e-5  # skipping is visible in the output


def test_prefill_and_mla_skip_counts_match_reference():
    q, k, v, bt, tok, kl = _peaked(tokens=3)
    q[1:] = q[0]  # all three tokens are queries of request 0, peaked on its keys
    tok = torch.zeros(3, dtype=torch.int32)
    kl = torch.tensor([254, 255, 256], dtype=torch.int32)
    st, rst = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    o, _ = paged_prefill(q, k, v, bt, tok, kl, threshold_scale_factor=2.0, stats=st)
    ro, _ = prefill_naive.paged_prefill(q, k, v, bt, tok, kl, threshold_scale_factor=2.0,
                                        stats=rst)
    assert st.tolist() == rst.tolist() and st[0] > 0
    torch.testing.assert_close(o, ro, **F32_TOL)

    latent = torch.cat([k[:, 0], k[:, 0, :, :16]], -1)  # rank 64 + rope 16
    qm = torch.cat([q, torch.zeros(3, 4, 16)], -1)
    kl = torch.full((3,), 256, dtype=torch.int32)
    st, rst = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    o, _ = sparse_mla_decode(qm, latent, bt, tok, kl, None, None, 64, 0.125,
                             threshold_scale_factor=2.0, stats=st)
    ro, _ = mla_naive.sparse_mla_decode(qm, latent, bt, tok, kl, None, None, 64, 0.125,
                                        threshold_scale_factor=2.0, stats=rst)
    assert st.tolist() == rst.tolist()
    torch.testing.assert_close(o, ro, **F32_TOL)
