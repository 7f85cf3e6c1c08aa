"""Prompt rows over runs of a paged cache (``kvsieve.kernels.prompt_runs``): the tiled native kernel
against its naive twin (a masked dense softmax over the whole cache) and the decode kernel on the
same runs, on causal DSA-like selections (every KV head the same positions, rows of one request
sharing blocks, more rows than one tile)."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from kvsieve.integrations.vllm.layouts import kv_views
from kvsieve.kernels.common.native import NativeUnavailable
from kvsieve.kernels.prompt_runs.naive import prompt_runs_naive
from kvsieve.kernels.prompt_runs.native import prompt_runs_native
from kvsieve.kernels.sparse_gqa_decode.native import sparse_decode_runs_native
from kvsieve.kernels.sparse_gqa_decode.runs import selection_runs
from kvsieve.selectors.streaming.selector import streaming_topk
from kvsieve.sparse import SparseRuntimeParams

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler on this machine: the native kernel cannot build")


def _cache(layout, num_blocks, hkv, bs, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    if layout == "vllm-cpu":  # K stored by channel
        return kv_views("vllm-cpu", torch.randn(num_blocks, hkv, bs, 2 * d, generator=gen).to(dtype))
    pool = torch.randn(num_blocks, 2, hkv, bs, d, generator=gen).to(dtype)
    return pool[:, 0], pool[:, 1]


def _prompt_runs(prompts, hkv, topk, bs, num_blocks, seed):
    """Two prompts' rows (request ``i``: ``prompts[i]`` tokens, positions 0..), each selecting up to
    ``topk`` random positions of its causal prefix (all of it when shorter), the same for every KV
    head; one row selects nothing (``-1`` only) -> the runs and the rows' kv_lens."""
    rng = np.random.default_rng(seed)
    tables = rng.permutation(num_blocks)[: len(prompts) * 8].reshape(len(prompts), 8).astype(np.int32)
    sel, table, lens = [], [], []
    for i, n in enumerate(prompts):
        for p in range(n):
            row = np.full(topk, -1, dtype=np.int64)
            pick = rng.permutation(p + 1)[:topk] if p + 1 > topk else np.arange(p + 1)
            row[: pick.size] = rng.permutation(pick)
            sel.append(row)
            table.append(tables[i])
            lens.append(p + 1)
    sel[5][:] = -1
    sel = torch.from_numpy(np.stack(sel))[:, None].expand(-1, hkv, -1)
    params = SparseRuntimeParams.from_topk(sel)
    lens = np.asarray(lens, dtype=np.int32)
    return selection_runs(params.sparse_attn_indices.numpy(), params.sparse_attn_offsets.numpy(), 1,
                          np.stack(table), lens, bs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["vllm-cpu", "HND"])
@pytest.mark.parametrize("hkv,g,d,bs,topk", [(3, 3, 64, 32, 40), (2, 4, 128, 16, 7), (1, 1, 32, 64, 300),
                                             (2, 5, 32, 32, 20)])
def test_prompt_runs_matches_naive_and_decode_kernel(dtype, layout, hkv, g, d, bs, topk):
    num_blocks = 24
    k, v = _cache(layout, num_blocks, hkv, bs, d, dtype, seed=d + bs)
    runs = _prompt_runs([70, 45], hkv, topk, bs, num_blocks, seed=topk)
    q = torch.randn(runs.num_rows, hkv * g, d, generator=torch.Generator().manual_seed(3))
    out, lse = prompt_runs_native(k, v, runs, q, sm_scale=d ** -0.5)
    n_out, n_lse = prompt_runs_naive(k, v, runs, q, sm_scale=d ** -0.5)
    d_out, d_lse = sparse_decode_runs_native(k, v, runs, q, sm_scale=d ** -0.5)
    assert bool(torch.isposinf(n_lse[5]).all()) and bool((n_out[5] == 0).all())  # the row with nothing
    assert torch.equal(torch.isposinf(lse), torch.isposinf(n_lse)) and bool((out[5] == 0).all())
    finite = torch.isfinite(n_lse)
    torch.testing.assert_close(out, n_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse[finite], n_lse[finite], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out, d_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse[finite], d_lse[finite], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["vllm-cpu", "HND"])
@pytest.mark.parametrize("d", [64, 48])  # 48: not a whole number of vectors, every block token by token
def test_prompt_runs_on_windows_matches_naive(dtype, layout, d):
    """Sinks and a recent window per row (streaming's selection: each block the tile's rows share is
    taken in the dense form), every fifth row selecting nothing (rows of a tile that skip a block)."""
    hkv, g, bs, num_blocks = 2, 3, 32, 24
    k, v = _cache(layout, num_blocks, hkv, bs, d, dtype, seed=d)
    table = np.random.default_rng(1).permutation(num_blocks)[:8].astype(np.int32)
    lens = torch.arange(100, 230)
    sel = streaming_topk(lens, 40, 3)
    sel[::5] = -1
    params = SparseRuntimeParams.from_topk(sel[:, None].expand(-1, hkv, -1).contiguous())
    runs = selection_runs(params.sparse_attn_indices.numpy(), params.sparse_attn_offsets.numpy(), 1,
                          np.tile(table, (lens.numel(), 1)), lens.numpy().astype(np.int32), bs)
    q = torch.randn(runs.num_rows, hkv * g, d, generator=torch.Generator().manual_seed(4))
    out, lse = prompt_runs_native(k, v, runs, q, sm_scale=d ** -0.5)
    n_out, n_lse = prompt_runs_naive(k, v, runs, q, sm_scale=d ** -0.5)
    assert bool(torch.isposinf(lse[::5]).all()) and bool((out[::5] == 0).all())
    finite = torch.isfinite(n_lse)
    torch.testing.assert_close(out, n_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse[finite], n_lse[finite], atol=2e-5, rtol=2e-5)


def test_prompt_runs_refuses_past_its_shapes_and_without_library(monkeypatch):
    k, v = _cache("vllm-cpu", 8, 1, 16, 64, torch.float32, seed=0)
    runs = _prompt_runs([8], 1, 4, 16, 8, seed=0)
    with pytest.raises(RuntimeError, match=r"kvsieve_prompt_runs returned -1 \(D=64, G=17\)"):
        prompt_runs_native(k, v, runs, torch.randn(runs.num_rows, 17, 64), sm_scale=0.1)
    monkeypatch.setenv("KVSIEVE_NATIVE", "0")
    with pytest.raises(NativeUnavailable, match="KVSIEVE_NATIVE=0"):
        prompt_runs_native(k, v, runs, torch.randn(runs.num_rows, 1, 64), sm_scale=0.1)
