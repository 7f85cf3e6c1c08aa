"""The native CPU page top-k (``kvsieve.kernels.page_topk``) against its naive twin and an
independent per-page loop; its build, cache and fallback."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kvsieve.kernels.common import native as build
from kvsieve.kernels.page_topk.plan import page_topk
from kvsieve.kernels.page_topk.naive import page_topk_naive
from kvsieve.kernels.page_topk.native import SOURCE

HAS_CC = shutil.which("cc") is not None or shutil.which("gcc") is not None
needs_cc = pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine: the native kernel cannot build")


def _case(hkv: int, g: int, d: int, sub: int, n_pages: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    n_blk = -(-n_pages // sub)
    pool = torch.randn(n_blk + 7, hkv, sub, 2, d, generator=gen)
    pool = torch.stack([pool.amin(3), pool.amax(3)], dim=3).to(dtype)  # min <= max, as summaries are
    ids = torch.randperm(n_blk + 7, generator=gen)[:n_blk]  # scattered, not ascending
    q = torch.randn(hkv * g, d, generator=gen)
    return pool, ids, q


def _loop_reference(pool, ids, n_pages, q, sm_scale, mode, k):
    """Page by page, head by head, in float64: the formula, then a Python sort (ties: lower page)."""
    hkv, sub, d = pool.shape[1], pool.shape[2], pool.shape[4]
    qg = q.double().view(hkv, -1, d)
    out = []
    for h in range(hkv):
        rows = [pool[int(ids[p // sub]), h, p % sub].double() for p in range(n_pages)]  # [2, D] each
        if mode == "sign":
            positive = qg[h].sum(0) > 0
            logits = torch.stack([qg[h] @ torch.where(positive, r[1], r[0]) for r in rows], -1)
        else:
            logits = torch.stack([torch.maximum(qg[h] * r[0], qg[h] * r[1]).sum(-1) for r in rows], -1)
        score = torch.softmax(logits * sm_scale, -1).mean(0).tolist()
        score[n_pages - 1] = 2.0
        best = sorted(range(n_pages), key=lambda p: (-score[p], p))[:k]
        out.append(sorted(best))
    return torch.tensor(out, dtype=torch.int32)


GEOMETRIES = [(3, 3, 64, 1, 300), (2, 4, 128, 4, 157), (1, 1, 80, 2, 33), (4, 2, 256, 1, 70), (2, 16, 64, 8, 41)]


@needs_cc
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["bound", "sign"])
@pytest.mark.parametrize("hkv,g,d,sub,n_pages", GEOMETRIES)
def test_native_matches_naive_and_the_loop(dtype, mode, hkv, g, d, sub, n_pages):
    pool, ids, q = _case(hkv, g, d, sub, n_pages, dtype)
    for k in (1, 7, n_pages):
        got = page_topk(pool, ids, n_pages, q, sm_scale=d ** -0.5, mode=mode, k=k)
        assert got.engine == "native"
        sel, scores = page_topk_naive(pool, ids, n_pages, q, sm_scale=d ** -0.5, mode=mode, k=k)
        assert torch.equal(got.indices, sel)
        torch.testing.assert_close(got.scores, scores, atol=1e-7, rtol=1e-5)
        assert torch.equal(got.indices, _loop_reference(pool, ids, n_pages, q, d ** -0.5, mode, k))


@needs_cc
def test_ties_go_to_the_lower_page_and_underflow_holds():
    """Repeated rows tie exactly (both engines pick the lower page); a scale that drives most pages'
    softmax share below fp32's normal range leaves the engines agreeing."""
    pool, ids, q = _case(2, 3, 64, 1, 96, torch.bfloat16, seed=3)
    pool[ids[48:95]] = pool[ids[:47]]  # pages 48..94 repeat pages 0..46
    for sm_scale, rtol in ((0.125, 1e-5), (40.0, 1e-3)):  # logits ~ +-400: sum order alone moves exp ~1e-4
        got = page_topk(pool, ids, 96, q, sm_scale=sm_scale, mode="bound", k=30)
        sel, scores = page_topk_naive(pool, ids, 96, q, sm_scale=sm_scale, mode="bound", k=30)
        assert got.engine == "native" and torch.equal(got.indices, sel)
        torch.testing.assert_close(got.scores, scores, atol=1e-30, rtol=rtol)
        for row in got.indices.tolist():  # a later twin only beside its earlier one
            assert all(p - 48 in row for p in row if 48 <= p < 95)
    assert (scores[:, :95] < 1e-30).float().mean() > 0.5  # the second scale did underflow most pages


def test_fp8_pools_and_native_off_run_the_naive_twin(monkeypatch):
    pool, ids, q = _case(2, 2, 64, 2, 50, torch.float32)
    want = page_topk_naive(pool, ids, 50, q, sm_scale=0.125, mode="bound", k=5)[0]
    monkeypatch.setenv(build.ENV_VAR, "0")
    off = page_topk(pool, ids, 50, q, sm_scale=0.125, mode="bound", k=5)
    assert off.engine == "naive" and torch.equal(off.indices, want)
    monkeypatch.delenv(build.ENV_VAR)
    fp8 = page_topk(pool.to(torch.float8_e5m2), ids, 50, q, sm_scale=0.125, mode="bound", k=5)
    assert fp8.engine == "naive"
    assert torch.equal(fp8.indices, page_topk_naive(pool.to(torch.float8_e5m2), ids, 50, q, sm_scale=0.125,
                                                    mode="bound", k=5)[0])


@pytest.mark.parametrize("kwargs,match", [
    (dict(k=0), "k must be in"), (dict(k=51), "k must be in"), (dict(mode="max"), "mode must be"),
    (dict(q=torch.randn(3, 64)), "q must be"), (dict(n_pages=60), "cannot hold"),
])
def test_bad_arguments_are_refused(kwargs, match):
    pool, ids, q = _case(2, 2, 64, 2, 50, torch.float32)
    args = dict(n_pages=50, q=q, sm_scale=0.125, mode="bound", k=5) | kwargs
    with pytest.raises(ValueError, match=match):
        page_topk(pool, ids, args.pop("n_pages"), args.pop("q"), **args)


@needs_cc
def test_build_is_cached_and_a_failed_build_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIEVE_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "page_topk_copy.c"
    src.write_text(SOURCE.read_text())
    build.native_library(src)
    built = list((tmp_path / "cache" / "native").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"
    stamp = built[0].stat().st_mtime_ns
    build._loaded.pop(src)  # a new process: the cached file is loaded, not rebuilt
    build.native_library(src)
    assert built[0].stat().st_mtime_ns == stamp

    broken = tmp_path / "broken.c"
    broken.write_text("int f( {")
    with pytest.warns(RuntimeWarning, match="broken.c is unavailable"), \
            pytest.raises(build.NativeUnavailable, match="failed on broken.c"):
        build.native_library(broken)
    assert build.native_status(broken).startswith("torch (")
    assert sorted(p.name for p in (tmp_path / "cache" / "native").iterdir()) == [built[0].name]  # no partial file
    monkeypatch.setenv("CC", str(Path("/nonexistent/cc")))
    other = tmp_path / "other.c"
    other.write_text(SOURCE.read_text() + "\n")
    with pytest.warns(RuntimeWarning, match="nonexistent"), pytest.raises(build.NativeUnavailable, match="nonexistent"):
        build.native_library(other)


@pytest.mark.parametrize("value", ["false", "off", "2", ""])
def test_a_switch_value_other_than_0_or_1_is_refused(monkeypatch, value):
    monkeypatch.setenv(build.ENV_VAR, value)
    with pytest.raises(ValueError, match="KVSIEVE_NATIVE must be 0"):
        build.native_library(SOURCE)


@needs_cc
@pytest.mark.parametrize("mode", ["bound", "sign"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_in_one_call_equal_page_topk_per_row(monkeypatch, mode, dtype):
    """``page_topk_rows`` (one native call; ``KVSIEVE_NATIVE=0``: per row) picks, for requests of
    different lengths and budgets side by side, the pages ``page_topk`` picks for each alone."""
    import numpy as np

    from kvsieve.kernels.page_topk.plan import page_topk_rows

    hkv, g, d, sub = 3, 3, 64, 2
    pool, _, _ = _case(hkv, g, d, sub, 40, dtype, seed=7)
    gen = torch.Generator().manual_seed(8)
    n_pages = np.array([40, 1, 17, 9])
    ks = np.array([8, 1, 17, 4])
    table = torch.stack([torch.randperm(pool.shape[0], generator=gen)[:20] for _ in range(4)]).numpy()
    q = torch.randn(4, hkv * g, d, generator=gen)
    want = torch.cat([page_topk(pool, torch.from_numpy(table[n]), int(n_pages[n]), q[n], sm_scale=0.125, mode=mode,
                                k=int(ks[n])).indices for n in range(4)], dim=1)
    assert torch.equal(page_topk_rows(pool, table.astype(np.int32), n_pages, q, sm_scale=0.125, mode=mode, ks=ks), want)
    monkeypatch.setenv("KVSIEVE_NATIVE", "0")
    assert torch.equal(page_topk_rows(pool, table, n_pages, q, sm_scale=0.125, mode=mode, ks=ks), want)
    with pytest.raises(ValueError, match="k must be in"):
        page_topk_rows(pool, table, n_pages, q, sm_scale=0.125, mode=mode, ks=np.array([8, 2, 17, 4]))
