"""The page min/max summaries (``kvsieve.kernels.page_minmax``): the native kernel, its naive
twin and a plain loop over pages, heads, keys and channels write the same summary rows, for bf16
and fp32 keys and pools, pages of 1..page_size keys in blocks of a strided cache (channels
contiguous, and tokens contiguous as in vLLM's CPU layout), NaN channels included; nothing else in the pool is written; a page outside its block is refused before
anything is written (the decode-step refresh of Quest's pool through it:
tests/selectors/test_naive_vs_fast.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvsieve.kernels.common.native import NativeUnavailable
from kvsieve.kernels.page_minmax.plan import page_minmax, supports_native
from kvsieve.kernels.page_minmax.naive import page_minmax_naive
from kvsieve.kernels.page_minmax.native import page_minmax_native


def _loop(keys: torch.Tensor, blocks, starts, counts, pool: torch.Tensor) -> torch.Tensor:
    want = pool.clone()
    ps = keys.shape[2] // pool.shape[2]
    for b, s, n in zip(blocks, starts, counts):
        for h in range(keys.shape[1]):
            for c in range(keys.shape[3]):
                vals = [float(keys[b, h, t, c]) for t in range(s, s + n)]
                nan = any(math.isnan(v) for v in vals)
                want[b, h, s // ps, 0, c] = math.nan if nan else min(vals)
                want[b, h, s // ps, 1, c] = math.nan if nan else max(vals)
    return want


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _case(gen: np.random.Generator, key_dtype: torch.dtype, pool_dtype: torch.dtype, trial: int):
    hkv, bs, ps, d = int(gen.integers(1, 4)), 16, int(gen.choice([4, 8, 16])), int(gen.integers(1, 9)) * 8
    if trial % 2:  # kvsieve's cache: K then V rows in one block, channels contiguous
        cache = torch.from_numpy(gen.standard_normal((6, hkv, 2 * bs, d)) * 3).float().to(key_dtype)
        keys = cache[:, :, :bs]
    else:  # vLLM's CPU layout: a [2 * D, block_size] tile per (block, head), tokens contiguous
        cache = torch.from_numpy(gen.standard_normal((6, hkv, 2 * d, bs)) * 3).float().to(key_dtype)
        keys = cache[:, :, :d].transpose(2, 3)
    if trial % 3 == 0:
        keys[2, 0, 3, 1] = math.nan
    n = int(gen.integers(1, 7))  # distinct blocks: no page written twice
    blocks = gen.choice(6, n, replace=False).astype(np.int64)
    starts = gen.integers(0, bs // ps, n).astype(np.int64) * ps
    counts = np.array([int(gen.integers(1, ps + 1)) for _ in range(n)], dtype=np.int64)
    pool = torch.from_numpy(gen.standard_normal((6, hkv, bs // ps, 2, d))).float().to(pool_dtype)
    return keys, blocks, starts, counts, pool


@pytest.mark.parametrize("key_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32])
def test_native_naive_and_loop_agree(key_dtype: torch.dtype, pool_dtype: torch.dtype) -> None:
    gen = np.random.default_rng(7)
    for trial in range(20):
        keys, blocks, starts, counts, pool = _case(gen, key_dtype, pool_dtype, trial)
        want = _loop(keys, blocks, starts, counts, pool)
        for fn in (page_minmax_naive, page_minmax):
            got = pool.clone()
            fn(keys, blocks, starts, counts, got)
            assert _same(got, want)
        assert supports_native(keys, pool)
        got = pool.clone()
        try:
            page_minmax_native(keys, blocks, starts, counts, got)
        except NativeUnavailable as e:
            pytest.skip(f"native library unavailable: {e}")
        assert _same(got, want)


def test_rounding_to_bf16_is_torchs_nearest_even() -> None:
    vals = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), 3.4e38, -1e-40])
    keys = vals.view(1, 1, 5, 1).expand(1, 1, 5, 8).contiguous()
    for n in range(1, 6):
        got, ref = (torch.zeros(1, 1, 1, 2, 8, dtype=torch.bfloat16) for _ in range(2))
        args = (np.array([0]), np.array([0]), np.array([n]))
        page_minmax(keys, *args, got)
        page_minmax_naive(keys, *args, ref)
        assert torch.equal(got, ref)


@pytest.mark.parametrize("blocks, starts, counts", [
    ([6], [0], [1]), ([-1], [0], [1]), ([0], [3], [1]), ([0], [0], [0]), ([0], [0], [9]), ([0], [8], [9]),
])
def test_a_page_outside_its_block_is_refused_before_anything_is_written(blocks, starts, counts) -> None:
    keys = torch.randn(6, 2, 16, 8)
    pool = torch.randn(6, 2, 2, 2, 8)  # pages of 8
    before = pool.clone()
    good = (np.array([1]), np.array([0]), np.array([4]))
    args = tuple(np.array(good[i].tolist() + a, dtype=np.int64) for i, a in enumerate((blocks, starts, counts)))
    for fn in (page_minmax_naive, page_minmax):
        with pytest.raises(ValueError, match="page_minmax: a page lies outside its block"):
            fn(keys, *args, pool)
        assert torch.equal(pool, before)


def test_what_the_native_kernel_does_not_take_runs_the_twin() -> None:
    keys = torch.randn(3, 2, 16, 8, dtype=torch.float16)
    pool = torch.zeros(3, 2, 2, 2, 8, dtype=torch.float16)
    assert not supports_native(keys, pool)
    assert page_minmax(keys, np.array([1]), np.array([8]), np.array([5]), pool) == "naive"
    assert torch.equal(pool[1, :, 1], torch.stack([keys[1, :, 8:13].amin(1), keys[1, :, 8:13].amax(1)], dim=1))
    fp8 = torch.zeros(3, 2, 2, 2, 8, dtype=torch.float8_e5m2)
    assert page_minmax(keys.float(), np.array([2]), np.array([0]), np.array([16 // 2]), fp8) == "naive"
    k = keys[2, :, :8].float()
    assert torch.equal(fp8[2, :, 0].float(), torch.stack([k.amin(1), k.amax(1)], dim=1).to(fp8.dtype).float())
