"""sparse_mla_decode: kernel vs naive reference vs float64 golden (interpreter).

Tolerances: see conftest. The latent cache is viewed as one KV head with V = first
kv_lora_rank columns, so the GQA golden applies with group = num_heads."""
from __future__ import annotations

import pytest
import torch

from conftest import (F32_TOL, GOLDEN_TOL, assert_close_lse, golden_attention,
                      make_block_table, make_selection)
from kvsieve.kernels.sparse_mla_decode import naive
from kvsieve.kernels.sparse_mla_decode.triton import sparse_mla_decode


def _setup(heads, rank, rope, page, batch, max_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv_lens = torch.randint(1, max_len + 1, (batch,), generator=g).to(torch.int32)
    kv_lens[0] = max_len
    bt = make_block_table(batch, max_len, page, batch * (-(-max_len // page) + 1) + 2, seed)
    latent = torch.randn(int(bt.max()) + 1, page, rank + rope, generator=g)
    q = torch.randn(batch, heads, rank + rope, generator=g) * 0.5
    return q, latent, bt, torch.arange(batch, dtype=torch.int32), kv_lens


def _golden(q, latent, bt, tok, kv_lens, idx, off, rank, scale):
    k4 = latent.unsqueeze(1)
    return golden_attention(q, k4, k4[..., :rank], bt, tok, kv_lens, idx, off, 1, scale)


@pytest.mark.parametrize("heads,page,batch", [(16, 16, 3), (128, 53, 1), (16, 1, 17)])
def test_mla_matches_reference_and_golden(heads, page, batch):
    rank, rope = 64, 16
    q, latent, bt, tok, kv_lens = _setup(heads, rank, rope, page, batch, 150)
    idx, off = make_selection(kv_lens.tolist(), 1, 1, 40)
    go, gl = _golden(q, latent, bt, tok, kv_lens, idx, off, rank, 0.1)
    for splits in (1, 2):
        o, l = sparse_mla_decode(q, latent, bt, tok, kv_lens, idx, off, rank, 0.1,
                                 num_splits=splits)
        ro, rl = naive.sparse_mla_decode(q, latent, bt, tok, kv_lens, idx, off, rank, 0.1,
                                         num_splits=splits)
        assert o.shape == (batch, heads, rank)
        torch.testing.assert_close(o, ro, **F32_TOL)
        assert_close_lse(l, rl, **F32_TOL)
        torch.testing.assert_close(o.double(), go, **GOLDEN_TOL)
        assert_close_lse(l, gl, **GOLDEN_TOL)


def test_mla_deepseek_dims_tiny_context():
    q, latent, bt, tok, kv_lens = _setup(16, 512, 64, 16, 2, 24)
    idx, off = make_selection(kv_lens.tolist(), 1, 1, 10)
    o, l = sparse_mla_decode(q, latent, bt, tok, kv_lens, idx, off, 512, 0.05)
    go, gl = _golden(q, latent, bt, tok, kv_lens, idx, off, 512, 0.05)
    torch.testing.assert_close(o.double(), go, **GOLDEN_TOL)
    assert_close_lse(l, gl, **GOLDEN_TOL)


def test_mla_dense_and_padding_rows():
    q, latent, bt, tok, kv_lens = _setup(16, 64, 16, 16, 3, 60)
    o, l = sparse_mla_decode(q, latent, bt, tok, kv_lens, None, None, 64, 0.1)
    go, gl = _golden(q, latent, bt, tok, kv_lens, None, None, 64, 0.1)
    torch.testing.assert_close(o.double(), go, **GOLDEN_TOL)
    idx = torch.tensor([[-1, -1, 3, 200]], dtype=torch.int32)
    off = torch.tensor([0, 2, 2, 4], dtype=torch.int32)
    o, l = sparse_mla_decode(q, latent, bt, tok, kv_lens, idx, off, 64, 0.1, num_splits=2)
    assert torch.all(o[:2] == 0) and torch.all(torch.isposinf(l[:2]))
    go, gl = _golden(q, latent, bt, tok, kv_lens, idx, off, 64, 0.1)
    torch.testing.assert_close(o.double(), go, **GOLDEN_TOL)
    assert_close_lse(l, gl, **GOLDEN_TOL)
