"""DSA's selection for many rows in one native call (``kvsieve.kernels.prompt_index``) against its
naive twin (a row at a time: its keys gathered, a stable sort): two requests' prompt rows over a paged
pool of index keys, short rows (every position), bf16 and fp32 keys, more rows than one tile."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from kvsieve.kernels.common.native import NativeUnavailable
from kvsieve.kernels.prompt_index.naive import prompt_index_topk_naive
from kvsieve.kernels.prompt_index.native import prompt_index_topk_native, supports_prompt_index

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler on this machine: the native kernel cannot build")


def _inputs(dtype, ih, id_, bs, prompts, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 40
    pool = torch.randn(num_blocks, bs, id_, generator=gen).to(dtype)
    table = np.random.default_rng(seed).permutation(num_blocks)[:2 * 12].reshape(2, 12).astype(np.int32)
    slots = np.concatenate([np.full(n, i, dtype=np.int32) for i, n in enumerate(prompts)])
    lens = np.concatenate([np.arange(1, n + 1, dtype=np.int32) for n in prompts])
    q = torch.randn(slots.size, ih, id_, generator=gen).to(dtype).float()  # rounded as the pool's keys
    w = torch.randn(slots.size, ih, generator=gen)
    return pool, table, slots, lens, q, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ih,id_,bs,k", [(4, 32, 32, 24), (3, 64, 16, 50), (9, 16, 64, 7)])
def test_prompt_index_matches_naive(dtype, ih, id_, bs, k):
    pool, table, slots, lens, q, w = _inputs(dtype, ih, id_, bs, [150, 61], seed=ih + k)
    assert supports_prompt_index(pool, q)
    got = prompt_index_topk_native(pool, table, slots, lens, q, w, k)
    want = prompt_index_topk_naive(pool, table, slots, lens, q, w, k)
    assert torch.equal(got, want)
    short = torch.from_numpy(lens <= k)
    assert bool((got[short][:, 0] == 0).all()) and bool((got[~short] >= 0).all())  # a short row: 0 .. len-1


def test_prompt_index_refuses_past_its_shapes_and_without_library(monkeypatch):
    pool, table, slots, lens, q, w = _inputs(torch.float32, 4, 32, 32, [20, 5], seed=0)
    assert not supports_prompt_index(pool.half(), q) and not supports_prompt_index(pool[:, :, :16], q)
    with pytest.raises(RuntimeError, match=r"kvsieve_prompt_index_topk returned -1 \(id=32, ih=65, k=4\)"):
        prompt_index_topk_native(pool, table, slots, lens, q[:, :1].expand(-1, 65, -1), w[:, :1].expand(-1, 65), 4)
    monkeypatch.setenv("KVSIEVE_NATIVE", "0")
    with pytest.raises(NativeUnavailable, match="KVSIEVE_NATIVE=0"):
        prompt_index_topk_native(pool, table, slots, lens, q, w, 4)
