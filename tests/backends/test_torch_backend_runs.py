"""The torch backend's run gather (contiguous pool rows through ``index_select``) against Vanilla.

HND and MLA caches take the run path; the run length is ``gcd(selection block size, page)``
(dense: the page), so sub-page, whole-page and multi-page selections each exercise a different
row shape. NHD caches take the per-token path; both must agree with the golden.
"""
from __future__ import annotations

import pytest
import torch

from kvsieve.sparse.backends import TorchBackend

from .harness import build, compare, random_selection


@pytest.mark.parametrize("block_size", [1, 4, 16, 32, 48])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_runs_match_vanilla(block_size, layout):
    md, q, geo = build(page=16, hq=8, hkv=2, d=16, ctx_lens=[37], gen_hist=[200, 16, 3], layout=layout,
                       seed=block_size)
    params = random_selection(md, 2, k=5, block_size=block_size, overshoot=1, seed=block_size + 1)
    compare("torch", md, q, geo, params)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_runs_low_precision_cache(dtype):
    md, q, geo = build(page=16, hq=4, hkv=1, d=32, ctx_lens=[], gen_hist=[130, 64], dtype=dtype)
    params = random_selection(md, 1, k=3, block_size=16)
    compare("torch", md, q, geo, params, rtol=2e-2, atol=2e-2)
    compare("torch", md, q, geo, None, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("block_size", [None, 8, 16])
def test_runs_mla(block_size):
    md, q, geo = build(page=16, hq=8, hkv=1, d=24, ctx_lens=[19], gen_hist=[70, 5], kind="mla", rank=16)
    params = None if block_size is None else random_selection(md, 1, k=4, block_size=block_size)
    compare("torch", md, q, geo, params)


def test_runs_chunked_equals_unchunked():
    md, q, geo = build(page=16, hq=4, hkv=2, d=16, ctx_lens=[40], gen_hist=[90, 33])
    params = random_selection(md, 2, k=3, block_size=16, pad_frac=0.0)
    for p in (None, params):
        a = TorchBackend().forward(q, md, 0, geo, p)
        b = TorchBackend(max_gather_bytes=1).forward(q, md, 0, geo, p)  # one token per chunk
        torch.testing.assert_close(a[0], b[0])
        torch.testing.assert_close(a[1], b[1])
