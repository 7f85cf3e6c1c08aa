"""Many decode rows over runs of a paged cache (``kvsieve.kernels.sparse_gqa_decode.native``:
``selection_runs`` + ``sparse_decode_runs_native``) against the naive twin and an independent
float64 softmax over the selected positions, looked up one by one through the block table."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from kvsieve.integrations.vllm.layouts import kv_views
from kvsieve.kernels.common.native import NativeUnavailable
from kvsieve.kernels.sparse_gqa_decode.naive import sparse_decode_runs_naive
from kvsieve.kernels.sparse_gqa_decode.native import sparse_decode_runs_native, supports_runs_native
from kvsieve.kernels.sparse_gqa_decode.runs import TokenRuns, selection_runs, selection_runs_naive
from kvsieve.sparse import SparseRuntimeParams

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler on this machine: the native kernel cannot build")


def _cache(layout, num_blocks, hkv, bs, d, dtype, seed):
    """K/V views ``[num_blocks, Hkv, bs, D]``: vLLM's CPU layout (K by channel) or kvsieve's HND pool (rows)."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "vllm-cpu":
        return kv_views("vllm-cpu", torch.randn(num_blocks, hkv, bs, 2 * d, generator=gen).to(dtype))
    pool = torch.randn(num_blocks, 2, hkv, bs, d, generator=gen).to(dtype)
    return pool[:, 0], pool[:, 1]


def _selection(kv_lens, hkv, units_of, keep, seed):
    """``[rows, Hkv, k]`` unit ids (``-1`` = none): a random ``keep`` fraction of each row's units,
    the newest always; row 1, head 0 selects nothing."""
    rng = np.random.default_rng(seed)
    width = max(-(-n // units_of) for n in kv_lens)
    sel = np.full((len(kv_lens), hkv, width), -1, dtype=np.int64)
    for r, n in enumerate(kv_lens):
        units = -(-n // units_of)
        for h in range(hkv):
            chosen = np.flatnonzero(rng.random(units) < keep)
            chosen = np.union1d(chosen, [units - 1])
            sel[r, h, : chosen.size] = rng.permutation(chosen)
    sel[1, 0] = -1
    return torch.from_numpy(sel)


def _float64_reference(k, v, sel, units_of, table, kv_lens, q, sm_scale):
    rows, hq, d = q.shape
    hkv, bs = k.shape[1], k.shape[2]
    g = hq // hkv
    out, lse = torch.zeros(rows, hq, d, dtype=torch.float64), torch.full((rows, hq), torch.inf, dtype=torch.float64)
    counts = np.zeros((rows, hkv), dtype=np.int64)
    for r in range(rows):
        for h in range(hkv):
            pos = [u * units_of + i for u in sel[r, h].tolist() if u >= 0 for i in range(units_of)
                   if u * units_of + i < kv_lens[r]]
            counts[r, h] = len(pos)
            if not pos:
                continue
            keys = torch.stack([k[table[r, p // bs], h, p % bs] for p in pos]).double()
            vals = torch.stack([v[table[r, p // bs], h, p % bs] for p in pos]).double()
            s = q[r, h * g:(h + 1) * g].double() @ keys.T * sm_scale
            lse[r, h * g:(h + 1) * g] = torch.logsumexp(s, -1)
            out[r, h * g:(h + 1) * g] = torch.softmax(s, -1) @ vals
    return out, lse, counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["vllm-cpu", "HND"])
@pytest.mark.parametrize("hkv,g,d,bs,units_of,keep", [(3, 3, 64, 32, 1, 0.2), (2, 4, 128, 16, 1, 0.9),
                                                      (2, 3, 64, 32, 8, 0.4), (1, 2, 64, 16, 64, 0.5)])
def test_runs_native_matches_naive_and_float64(dtype, layout, hkv, g, d, bs, units_of, keep):
    kv_lens = [200, 97, 33, 150]
    num_blocks = 64
    k, v = _cache(layout, num_blocks, hkv, bs, d, dtype, seed=d + bs)
    table = np.random.default_rng(0).permutation(num_blocks)[: 4 * 16].reshape(4, 16).astype(np.int32)
    sel = _selection(kv_lens, hkv, units_of, keep, seed=units_of)
    params = SparseRuntimeParams.from_topk(sel, block_size=units_of)
    args = (params.sparse_attn_indices.numpy(), params.sparse_attn_offsets.numpy(), units_of, table,
            np.asarray(kv_lens, dtype=np.int32), bs)
    runs = selection_runs(*args)
    _assert_same_runs(runs, selection_runs_naive(*args))
    q = torch.randn(4, hkv * g, d, generator=torch.Generator().manual_seed(3))
    assert supports_runs_native(k, v, q)
    out, lse = sparse_decode_runs_native(k, v, runs, q, sm_scale=d ** -0.5)
    n_out, n_lse = sparse_decode_runs_naive(k, v, runs, q, sm_scale=d ** -0.5)
    r_out, r_lse, counts = _float64_reference(k, v, sel, units_of, table, kv_lens, q, d ** -0.5)
    assert np.array_equal(runs.attended, counts) and counts[1, 0] == 0  # reads exactly the selection
    assert bool((runs.cnt > 0).all()) and bool((runs.start + runs.cnt <= bs).all())  # runs stay in their block
    torch.testing.assert_close(out, n_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), r_out, atol=2e-5, rtol=2e-5)
    assert torch.equal(torch.isposinf(lse), torch.isposinf(r_lse)) and bool(torch.isposinf(lse[1, :g]).all())
    finite = torch.isfinite(r_lse)
    torch.testing.assert_close(lse[finite].double(), r_lse[finite], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(n_lse[finite].double(), r_lse[finite], atol=2e-5, rtol=2e-5)


def _assert_same_runs(a: TokenRuns, b: TokenRuns) -> None:
    for field in ("ptr", "block", "head", "start", "cnt", "attended"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field


@pytest.mark.parametrize("build", [selection_runs, selection_runs_naive])
def test_consecutive_positions_in_a_block_are_one_run(build):
    """Positions 3..9 and 30..33 of 16-token blocks: runs 3-9, 30-31, 32-33 (a block boundary splits);
    the second row's segment, read from a column slice, is cut at its kv_len."""
    idx = np.array([[0, 3, 4, 5, 6, 7, 8, 9, 30, 31, 32, 33, -1, 1, 2, 5, -1]], dtype=np.int32)[:, 1:]
    table = np.array([[5, 2, 7, 0], [9, 1, 0, 0]], dtype=np.int32)[:, :3]
    runs = build(idx, np.array([0, 12, 16]), 1, table, np.array([40, 3]), 16)
    assert runs.ptr.tolist() == [0, 3, 4]
    assert runs.block.tolist() == [5, 2, 7, 9] and runs.start.tolist() == [3, 14, 0, 1]
    assert runs.cnt.tolist() == [7, 2, 2, 2] and runs.head.tolist() == [0, 0, 0, 0]
    assert runs.attended.tolist() == [[11], [2]]


def test_units_cut_at_block_boundaries_and_kv_len():
    """Units of 48 positions over 32-token blocks: pieces of 16, joined into runs within a block."""
    idx = np.array([[0, 2, -1], [1, 2, -1]], dtype=np.int32)
    args = (idx, np.array([0, 3]), 48, np.array([[4, 6, 8, 3, 1]], dtype=np.int32), np.array([130]), 32)
    runs = selection_runs(*args)
    _assert_same_runs(runs, selection_runs_naive(*args))
    # head 0: 0-47 (blocks 0, 1) and 96-129 (blocks 3, 4); head 1: 48-129 (blocks 1..4)
    assert runs.block.tolist() == [4, 6, 3, 1, 6, 8, 3, 1] and runs.cnt.tolist() == [32, 16, 32, 2, 16, 32, 32, 2]
    assert runs.attended.tolist() == [[82, 82]]


def test_unsupported_views_and_unavailable_library(monkeypatch):
    k, v = _cache("vllm-cpu", 4, 2, 16, 64, torch.float32, seed=0)
    q = torch.randn(1, 4, 64)
    assert not supports_runs_native(k.half(), v.half(), q)  # fp16 caches: the caller's PyTorch path
    assert not supports_runs_native(k, v, torch.randn(1, 2 * 17, 64))  # G past the kernel's 16
    assert not supports_runs_native(k.transpose(0, 1), v, q)
    args = (np.array([[0, 1], [2, -1]], dtype=np.int32), np.array([0, 2]), 1, np.array([[1]], dtype=np.int32),
            np.array([3]), 16)
    runs = selection_runs(*args)
    with pytest.raises(ValueError, match="past its row's block table"):
        selection_runs(args[0], args[1], 1, args[3], np.array([40]), 2)
    monkeypatch.setenv("KVSIEVE_NATIVE", "0")
    with pytest.raises(NativeUnavailable, match="KVSIEVE_NATIVE=0"):
        sparse_decode_runs_native(k, v, runs, q, sm_scale=0.125)
    _assert_same_runs(selection_runs(*args), runs)  # the numpy twin without the library
