"""Each request's last query rows over its paged cache, each row causal (``kvsieve.kernels.causal_rows``):
the native kernel (a request's rows folded into one query group, blocks cut into parts when the
requests are few) against its naive twin and against the decode kernel run one row at a time over
the row's causal runs, on both cache layouts and dtypes; NaN past every request's length (unwritten
slots) must not reach the output."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from kvsieve.integrations.vllm.layouts import kv_views
from kvsieve.kernels.causal_rows import causal_rows_naive, causal_rows_native, supports_causal_rows
from kvsieve.kernels.sparse_gqa_decode.native import sparse_decode_runs_native
from kvsieve.kernels.sparse_gqa_decode.runs import selection_runs_naive

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler on this machine: the native kernel cannot build")


def _cache(layout, num_blocks, hkv, bs, d, dtype, lens, table, seed):
    """K/V views with random values at every request's positions and NaN everywhere else."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "vllm-cpu":  # K stored by channel
        raw = torch.full((num_blocks, hkv, bs, 2 * d), float("nan"), dtype=dtype)
        k, v = kv_views("vllm-cpu", raw)
    else:
        pool = torch.full((num_blocks, 2, hkv, bs, d), float("nan"), dtype=dtype)
        k, v = pool[:, 0], pool[:, 1]
    for r, n in enumerate(lens):
        pos = torch.arange(int(n))
        blocks = torch.as_tensor(table[r], dtype=torch.int64)[pos // bs]
        k[blocks, :, pos % bs] = torch.randn(int(n), hkv, d, generator=gen).to(dtype)
        v[blocks, :, pos % bs] = torch.randn(int(n), hkv, d, generator=gen).to(dtype)
    return k, v


def _rows_one_by_one(k, v, table, qo, lens, q, sm_scale):
    """The decode kernel, each row over the runs of its own causal prefix."""
    rows = np.repeat(np.arange(len(lens)), np.diff(qo))
    row_len = np.concatenate([np.arange(n - (b - a) + 1, n + 1) for n, a, b in zip(lens, qo[:-1], qo[1:])])
    every = np.concatenate([np.arange(n) for n in row_len]).astype(np.int32)
    hkv, bs = k.shape[1], k.shape[2]
    runs = selection_runs_naive(np.tile(every, (hkv, 1)), np.concatenate([[0], np.cumsum(row_len)]), 1,
                                table[rows], row_len, bs)
    return sparse_decode_runs_native(k, v, runs, q, sm_scale=sm_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["vllm-cpu", "HND"])
@pytest.mark.parametrize("hkv,g,d,bs,rows", [
    (3, 3, 64, 128, (3, 3, 1, 3)),  # SmolLM2's heads, K = 2 verify rows beside a request that drafted nothing
    (1, 4, 256, 32, (5, 2)),  # Gemma 3's heads: 5 rows x 4 heads fold into 20 of the 32 a task takes
    (2, 3, 32, 16, (12, 1)),  # 12 rows x 3 heads > 32: the rows go in two tasks
    (2, 1, 8, 16, (1,)),  # one request, one row: its blocks cut into parts for the threads
])
@pytest.mark.parametrize("threads", [1, 2])
def test_causal_rows_matches_naive_and_rows_one_by_one(dtype, layout, hkv, g, d, bs, rows, threads):
    rng = np.random.default_rng(0)
    n_req = len(rows)
    lens = np.array([max(r, int(x)) for r, x in zip(rows, rng.integers(1, 9 * bs, n_req))], dtype=np.int64)
    lens[0] = 5 * bs + 3  # rows crossing a block boundary
    width = int(-(-lens.max() // bs)) + 1
    table = rng.permutation(n_req * width).astype(np.int32).reshape(n_req, width)  # blocks out of order
    k, v = _cache(layout, n_req * width, hkv, bs, d, dtype, lens, table, 1)
    qo = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
    q = torch.randn(int(qo[-1]), hkv * g, d, generator=torch.Generator().manual_seed(2))
    assert supports_causal_rows(k, v, q)
    out, lse = causal_rows_native(k, v, table, qo, lens, q, sm_scale=d ** -0.5, threads=threads)
    ref_out, ref_lse = causal_rows_naive(k, v, table, qo, lens, q, sm_scale=d ** -0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)
    one_out, one_lse = _rows_one_by_one(k, v, table, qo, lens, q, d ** -0.5)
    torch.testing.assert_close(out, one_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, one_lse, atol=2e-5, rtol=2e-5)


def test_the_last_row_sees_what_the_others_do_not():
    """A row's result changes with a later position only for the rows at or after it (causality)."""
    hkv, g, d, bs = 1, 2, 16, 16
    table = np.arange(4, dtype=np.int32)[None]
    lens = np.array([40])
    k, v = _cache("vllm-cpu", 4, hkv, bs, d, torch.float32, lens, table, 3)
    q = torch.randn(3, hkv * g, d)
    qo = np.array([0, 3])
    before, _ = causal_rows_native(k, v, table, qo, lens, q, sm_scale=0.25)
    v[2, :, 39 - 2 * bs] += 10.0  # position 39 (block 2): the last row's own
    after, _ = causal_rows_native(k, v, table, qo, lens, q, sm_scale=0.25)
    torch.testing.assert_close(after[:2], before[:2], atol=0, rtol=0)
    assert (after[2] - before[2]).abs().max() > 1e-3


@pytest.mark.parametrize("case", ["d_not_multiple_of_8", "group_over_32", "vllm_block_not_multiple_of_16",
                                  "k_by_neither", "dtypes_differ"])
def test_inputs_the_kernel_does_not_take_are_refused_by_supports(case):
    d, bs, g = {"d_not_multiple_of_8": (20, 16, 2), "group_over_32": (16, 16, 33),
                "vllm_block_not_multiple_of_16": (16, 8, 2)}.get(case, (16, 16, 2))
    raw = torch.zeros(4, 1, bs, 2 * d)
    k, v = kv_views("vllm-cpu", raw)
    if case == "k_by_neither":
        k = torch.zeros(4, 1, d, bs).transpose(2, 3)[:, :, ::2]  # neither channels nor tokens contiguous
        v = torch.zeros(4, 1, bs // 2, d)
    if case == "dtypes_differ":
        v = v.to(torch.bfloat16)
    assert not supports_causal_rows(k, v, torch.zeros(2, g, d))


def test_calls_the_kernel_cannot_honour_are_refused_by_name_with_nothing_computed():
    """A table narrower than a request's positions, rows not matching ``qo_indptr``, an indptr of the
    wrong length, threads below 1: each a ``ValueError`` naming it (the kernel never reads past the
    table row it is given)."""
    hkv, g, d, bs = 1, 2, 16, 16
    table = np.arange(4, dtype=np.int32)[None]  # 4 blocks: 64 positions
    k, v = _cache("vllm-cpu", 8, hkv, bs, d, torch.float32, [64], table, 4)
    q = torch.randn(2, hkv * g, d)
    qo = np.array([0, 2])
    with pytest.raises(ValueError, match="block_table has 4 blocks a row, fewer than kv_lens \\[65\\] need"):
        causal_rows_native(k, v, table, qo, np.array([65]), q, sm_scale=0.25)
    with pytest.raises(ValueError, match="q has 2 rows, qo_indptr ends at 3"):
        causal_rows_native(k, v, table, np.array([0, 3]), np.array([64]), q, sm_scale=0.25)
    with pytest.raises(ValueError, match="qo_indptr has 3 entries for 1 requests"):
        causal_rows_native(k, v, table, np.array([0, 1, 2]), np.array([64]), q, sm_scale=0.25)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        causal_rows_native(k, v, table, qo, np.array([64]), q, sm_scale=0.25, threads=0)
    with pytest.raises(ValueError, match="block_table must be \\[n_req >= 1, blocks\\]"):
        causal_rows_native(k, v, table[0], qo, np.array([64]), q, sm_scale=0.25)
    out, _ = causal_rows_native(k, v, table, qo, np.array([64]), q, sm_scale=0.25)  # the same call, in bounds
    assert torch.isfinite(out).all()
