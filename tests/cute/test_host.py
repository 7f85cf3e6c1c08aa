"""CPU checks of the CuTe host side: index translation, FP8 format helpers, split merge,
validation errors and the backend's device refusal."""
from __future__ import annotations

import math

import pytest
import torch

from kvsieve.kernels.common.gather.cute.host import merge_splits, pad_rows, request_local_to_rows
from kvsieve.kernels.sparse_mla_decode.fp8 import dequantize_fp8_mla, quantize_fp8_mla
from kvsieve.kernels.sparse_mla_decode.naive import sparse_mla_decode as bf16_reference
from kvsieve.kernels.sparse_mla_decode.naive import sparse_mla_decode_fp8_reference


def test_request_local_to_rows_tokens_and_blocks():
    bt = torch.tensor([[3, 1, 2], [5, 4, 0]], dtype=torch.int32)
    t2r = torch.tensor([0, 1], dtype=torch.int32)
    lens = torch.tensor([9, 6], dtype=torch.int32)
    idx = torch.tensor([[0, 5, -1, 9, 1, 2]], dtype=torch.int32)
    off = torch.tensor([0, 4, 6], dtype=torch.int32)
    rows = request_local_to_rows(idx, off, t2r, bt, lens, 4, 1)
    assert rows.tolist() == [[[12, 5, -1, -1]], [[21, 22, -1, -1]]]  # 9 >= kv_len -> -1
    idx2 = torch.tensor([[0, 2, 1], [1, -1, 0]], dtype=torch.int32)
    off2 = torch.tensor([0, 2, 3], dtype=torch.int32)
    rows2 = request_local_to_rows(idx2, off2, t2r, bt, lens, 4, 2)
    assert rows2.tolist() == [[[12, 13, 4, 5], [14, 15, -1, -1]],
                              [[22, 23, -1, -1], [20, 21, -1, -1]]]


def test_pad_rows():
    r = torch.arange(5, dtype=torch.int32).view(1, 1, 5)
    p = pad_rows(r, 4)
    assert p.shape[-1] == 8 and p[0, 0, 5:].eq(-1).all()
    assert pad_rows(torch.empty(2, 1, 0, dtype=torch.int32), 64).shape[-1] == 64


def test_fp8_roundtrip_format():
    x = torch.randn(3, 7, 576).bfloat16()
    c = quantize_fp8_mla(x)
    assert c.shape == (3, 7, 656) and c.dtype == torch.uint8
    scales = c[..., 512:528].contiguous().view(torch.float32)
    assert torch.equal(torch.exp2(torch.log2(scales).round()), scales)  # powers of two
    d = dequantize_fp8_mla(c)
    assert torch.equal(d[..., 512:], x[..., 512:])  # rope kept in bf16
    rel = (d[..., :512].float() - x[..., :512].float()).abs().max() / x.float().abs().max()
    assert rel < 0.07


def test_fp8_reference_is_bf16_reference_on_dequantized_cache():
    g = torch.Generator().manual_seed(0)
    latent = torch.randn(6, 53, 576, generator=g).bfloat16()
    c = quantize_fp8_mla(latent)
    q = torch.randn(2, 64, 576, generator=g).bfloat16()
    bt = torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int32)
    t2r = torch.tensor([0, 1], dtype=torch.int32)
    lens = torch.tensor([150, 60], dtype=torch.int32)
    idx = torch.tensor([[0, 7, 149, 52, -1, 3, 59, 70]], dtype=torch.int32)
    off = torch.tensor([0, 5, 8], dtype=torch.int32)
    o, l = sparse_mla_decode_fp8_reference(q, c, bt, t2r, lens, idx, off)
    o2, l2 = bf16_reference(q, dequantize_fp8_mla(c), bt, t2r, lens, idx, off, 512)
    assert torch.equal(o, o2) and torch.equal(l, l2)
    assert o.shape == (2, 64, 512) and torch.isfinite(l).all()


def test_merge_splits_matches_single_softmax():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(3, 40, generator=g)
    v = torch.randn(40, 8, generator=g)
    full_lse = torch.logsumexp(s, -1)
    full = torch.softmax(s, -1) @ v
    parts_o, parts_l = [], []
    for lo, hi in ((0, 16), (16, 40), (40, 40)):
        if hi == lo:
            parts_o.append(torch.zeros(3, 8))
            parts_l.append(torch.full((3,), math.inf))
            continue
        parts_l.append(torch.logsumexp(s[:, lo:hi], -1))
        parts_o.append(torch.softmax(s[:, lo:hi], -1) @ v[lo:hi])
    o, l = merge_splits(torch.stack(parts_o)[:, None], torch.stack(parts_l)[:, None],
                        torch.float32)
    assert torch.allclose(o[0], full, atol=1e-5) and torch.allclose(l[0], full_lse, atol=1e-5)
    empty_o, empty_l = merge_splits(torch.zeros(2, 1, 3, 8),
                                    torch.full((2, 1, 3), math.inf), torch.float32)
    assert empty_o.eq(0).all() and torch.isposinf(empty_l).all()


def test_cute_entry_points_refuse_cpu():
    from kvsieve.kernels.sparse_gqa_decode.cute import sparse_gqa_decode
    from kvsieve.kernels.sparse_mla_decode.cute import sparse_mla_decode_slots

    q = torch.zeros(1, 64, 576, dtype=torch.bfloat16)
    cache = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="triton"):
        sparse_mla_decode_slots(q, cache, torch.zeros(1, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="cache"):
        sparse_mla_decode_slots(q, torch.zeros(2, 64, 575, dtype=torch.bfloat16),
                                torch.zeros(1, 64, dtype=torch.int32))
    k = torch.zeros(2, 1, 16, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="triton"):
        sparse_gqa_decode(torch.zeros(1, 4, 128, dtype=torch.bfloat16), k, k,
                          torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                          torch.ones(1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
                          torch.tensor([0, 1], dtype=torch.int32))


def test_backend_refuses_without_sm90_sm100():
    from kvsieve.sparse.backends.cute import CuteBackend

    with pytest.raises(ValueError, match="'vanilla'"):
        CuteBackend.check_device(torch.device("cpu"))
    assert CuteBackend.name == "cute"
