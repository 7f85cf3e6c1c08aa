"""Bad input raises ValueError naming the argument; launch heuristics."""
from __future__ import annotations

import pytest
import torch

from kvsieve.kernels.common import launch
from kvsieve.kernels.common.indexing import effective_attended_tokens, to_physical_slots
from kvsieve.kernels.paged_prefill.triton import paged_prefill
from kvsieve.kernels.sparse_gqa_decode.triton import sparse_gqa_decode
from kvsieve.kernels.sparse_mla_decode.triton import sparse_mla_decode


def _args():
    q = torch.randn(2, 4, 64)
    k = torch.randn(5, 2, 16, 64)
    bt = torch.ones(2, 3, dtype=torch.int32)
    tok = torch.arange(2, dtype=torch.int32)
    kl = torch.tensor([5, 9], dtype=torch.int32)
    idx = torch.zeros(2, 4, dtype=torch.int32)
    off = torch.tensor([0, 2, 4], dtype=torch.int32)
    return q, k, k.clone(), bt, tok, kl, idx, off


@pytest.mark.parametrize("mutate,name", [
    (lambda a: a.__setitem__(6, a[6].long()), "indices"),
    (lambda a: a.__setitem__(7, a[7][:2]), "offsets"),
    (lambda a: a.__setitem__(1, a[1].half()), "k_cache"),
    (lambda a: a.__setitem__(0, torch.randn(2, 3, 64)), "q"),
    (lambda a: a.__setitem__(3, a[3].long()), "block_table"),
    (lambda a: a.__setitem__(5, a[5][:1]), "kv_lens"),
    (lambda a: a.__setitem__(7, None), "indices/offsets"),
])
def test_gqa_bad_inputs(mutate, name):
    a = list(_args())
    mutate(a)
    with pytest.raises(ValueError, match=name):
        sparse_gqa_decode(*a)


@pytest.mark.parametrize("kw,name", [
    (dict(num_splits=0), "num_splits"), (dict(threshold_scale_factor=-1.0), "threshold"),
    (dict(block_size=0), "block_size"), (dict(sm_scale=float("nan")), "sm_scale"),
    (dict(stats=torch.zeros(3, dtype=torch.int32)), "stats")])
def test_gqa_bad_options(kw, name):
    with pytest.raises(ValueError, match=name):
        sparse_gqa_decode(*_args(), **kw)
    with pytest.raises(ValueError, match=name):
        paged_prefill(*_args(), **kw)


def test_mla_bad_inputs():
    q = torch.randn(1, 16, 80)
    lat = torch.randn(4, 16, 80)
    bt = torch.ones(1, 2, dtype=torch.int32)
    tok, kl = torch.zeros(1, dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        sparse_mla_decode(q, lat, bt, tok, kl, None, None, 48)
    with pytest.raises(ValueError, match="latent_cache"):
        sparse_mla_decode(q, lat[..., :64], bt, tok, kl, None, None, 64)
    with pytest.raises(ValueError, match="indices"):
        sparse_mla_decode(q, lat, bt, tok, kl, torch.zeros(2, 3, dtype=torch.int32),
                          torch.tensor([0, 3], dtype=torch.int32), 64)


def test_helper_bad_inputs():
    idx = torch.zeros(1, 2, dtype=torch.int32)
    off = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_size"):
        to_physical_slots(idx, off, torch.zeros(1, dtype=torch.int32),
                          torch.ones(1, 2, dtype=torch.int32), 16, 4)
    with pytest.raises(ValueError, match="kv_lens"):
        effective_attended_tokens(idx, off, torch.tensor([3]), 1, 16)


def test_launch_heuristics():
    assert launch.detect_arch(torch.device("cpu")) == "interpreter"
    assert launch.choose_num_splits("sm90", 1, 64, 16) == 16  # 1 program, long walk
    assert launch.choose_num_splits("sm90", 8, 8, 16) == 2  # bounded by work per split
    assert launch.choose_num_splits("sm90", 4096, 64, 16) == 1  # GPU already full
    assert launch.choose_num_splits("interpreter", 1, 64, 1) == 1
    assert launch.mla_decode_config("sm100", 16).block_h == 16
    assert launch.mla_decode_config("sm100", 128).block_h == 64
    with pytest.raises(ValueError, match="arch"):
        launch.gqa_decode_config("sm75", 128)
