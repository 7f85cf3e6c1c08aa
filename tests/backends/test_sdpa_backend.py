"""The registered ``sdpa`` backend: dense steps through torch SDPA (no LSE), every other step whole
through its inner backend, whose result (paths, counts, skip statistics) comes back unchanged."""
from __future__ import annotations

import pytest
import torch

from kvsieve import SparseRuntimeParams
from kvsieve.sparse.backends import get_backend

from .harness import build, random_selection


def test_dense_step_runs_sdpa_and_matches_the_golden():
    md, q, geo = build(page=4, hq=4, hkv=2, d=16, ctx_lens=[13, 7], gen_hist=[21, 2], seed=1)
    res = get_backend("sdpa").forward(q, md, 0, geo, None)
    ref = get_backend("vanilla").forward(q, md, 0, geo, None)
    torch.testing.assert_close(res.out, ref.out, rtol=1e-5, atol=1e-5)
    assert res.lse is None and res.paths == {"context": "sdpa_dense", "generation": "sdpa_dense"}
    assert torch.equal(res.attended, ref.attended)


def test_selection_goes_whole_to_the_inner_backend():
    md, q, geo = build(page=4, hq=4, hkv=2, d=16, ctx_lens=[13], gen_hist=[21, 2], seed=2)
    params = random_selection(md, 2, k=3, block_size=1, seed=4)
    res = get_backend("sdpa", inner="torch").forward(q, md, 0, geo, params)
    own = get_backend("torch").forward(q, md, 0, geo, params)
    assert torch.equal(res.out, own.out) and torch.equal(res.lse, own.lse)
    assert res.paths == own.paths and torch.equal(res.attended, own.attended)


def test_a_generation_only_skip_factor_is_not_served_dense():
    """The observed bug: a decode-only skip-softmax factor went through SDPA (lse NaN, nothing skipped)."""
    md, q, geo = build(page=16, hq=4, hkv=1, d=16, ctx_lens=[], gen_hist=[300], seed=5)
    params = SparseRuntimeParams(threshold_scale_factor_generation=1e4)
    res = get_backend("sdpa", inner="triton").forward(q, md, 0, geo, params)
    assert res.paths == {"generation": "decode_gather"} and res.lse is not None
    assert 0 < res.skipped_tiles <= res.walked_tiles  # the Triton counters pass through
    own = get_backend("sdpa").forward(q, md, 0, geo, params)  # inner vanilla: the same tile walk
    assert own.paths == {"generation": "skip_gather"} and own.lse is not None
    assert (own.skipped_tiles, own.walked_tiles) == (res.skipped_tiles, res.walked_tiles)


def test_sdpa_cannot_wrap_itself():
    with pytest.raises(ValueError, match="cannot be sdpa itself"):
        get_backend("sdpa", inner=get_backend("sdpa"))
