"""skip_softmax end to end: factor 0 equals dense exactly; a skipping factor skips tiles (counted by
the kernel) and changes the output measurably; calibration fits a*exp(b*s) and hits its target, or
bisects the measured curve and hits it closer."""
from __future__ import annotations

import pytest
import torch

import kvsieve
from kvsieve import Engine, KVCacheManager, KVCacheSpec, SparseAttention, SparseAttentionConfig, lower_config
from kvsieve.selectors.skip_softmax.selector import calibrate_threshold, interpolate_factor, measure_skip_fraction


def peaked_context(length=512, hkv=1, d=32, seed=0, amp=6.0):
    """Keys where a few early positions dominate each query, so late tiles are skippable."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(length, hkv, d, generator=g)
    v = torch.randn(length, hkv, d, generator=g)
    k[:8] *= amp
    return k, v


def engine(params, backend="triton"):
    spec = KVCacheSpec(num_layers=1, num_blocks=40, tokens_per_block=16, num_kv_heads=1, head_dim=32,
                       max_requests=2, max_blocks_per_seq=40)
    plan = None if params is None else lower_config(SparseAttentionConfig("skip_softmax", params), num_layers=1)[0]
    layer = SparseAttention(layer_idx=0, num_q_heads=4, num_kv_heads=1, head_dim=32, plan=plan, backend=backend)
    return Engine(KVCacheManager(spec), [layer], max_num_requests=2, max_num_tokens=600)


def decode_once(eng, k, v, q):
    eng.step([0], [k.shape[0]], 1, [(torch.zeros(k.shape[0], 4, 32), k, v)])
    (res,) = eng.step([0], [1], 0, [(q, k[:1], v[:1])])
    out, _ = res.out, res.lse
    return out, res.stats


def test_factor_zero_is_dense_and_skipping_factor_skips():
    k, v = peaked_context()
    q = k[:8].mean(0).repeat(4, 1).unsqueeze(0) * 0.3 + 0.1 * torch.randn(1, 4, 32)
    dense, _ = decode_once(engine(None), k, v, q)
    zero, st0 = decode_once(engine({"threshold_scale_factor_generation": 0.0, "threshold_scale_factor_context": 0.0}), k, v, q)
    assert torch.equal(dense, zero) and st0.skipped_tiles == 0
    skip, st = decode_once(engine({"threshold_scale_factor_generation": 1e4}), k, v, q)
    assert st.skipped_tiles > 0 and st.walked_tiles > st.skipped_tiles
    assert st.computed_fraction < st.attended_fraction
    diff = (skip - dense).abs().max().item()
    assert 1e-7 < diff < 0.5, diff  # measurable, yet far from garbage


def _calibration_samples():
    samples = []
    for seed in range(3):
        k, v = peaked_context(length=768, seed=seed, amp=1.5)
        q = k[:8].mean(0).repeat(4, 1).unsqueeze(0) * 0.5 + torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(seed))
        samples.append((q, k, v))
    return samples


def test_bisected_calibration_hits_every_target_within_a_tile():
    samples = _calibration_samples()
    walked = 3 * 2 * 4 * (768 // 64)  # samples x queries x heads x tiles: one tile is 1/288 of the fraction
    grid = [10.0 ** e for e in range(-1, 4)]
    targets = (0.3, 0.5, 0.7)
    points = calibrate_threshold(samples, targets, factors=grid, steps=10)
    assert len(points) > len(grid)  # bisection measured more points
    for t in targets:
        achieved = measure_skip_fraction(samples, interpolate_factor(points, t))
        assert abs(achieved - t) <= 3 / walked, (t, achieved)
    sel = kvsieve.create_selector("skip_softmax", target_sparsity=0.5, threshold_scale_factor_context=0.0,
                                  calibration_points={"generation": points})
    assert sel.config.factor("generation") == interpolate_factor(points, 0.5)
    with pytest.raises(ValueError, match=r"calibrate_threshold: target sparsity 0\.999 is outside the measured "
                                         r"skipped fractions \[\d\.\d{4}, \d\.\d{4}\] at factors"):
        calibrate_threshold(samples, (0.999,), factors=grid)


def test_interpolate_factor_is_log_linear_between_the_bracketing_points_and_refuses_outside():
    pts = ((100.0, 0.6), (1.0, 0.0), (10.0, 0.2))  # any order
    assert interpolate_factor(pts, 0.4) == pytest.approx(10 ** 1.5)
    assert interpolate_factor(pts, 0.2) == pytest.approx(10.0)
    assert interpolate_factor(pts, 0.0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"target sparsity 0.7 is outside the measured skipped fractions \[0.0000, 0.6000\]"):
        interpolate_factor(pts, 0.7)
    with pytest.raises(ValueError, match="factor > 0"):
        interpolate_factor(((0.0, 0.1), (1.0, 0.2)), 0.15)


@pytest.mark.parametrize("kwargs,match", [
    ({}, "skip_softmax.threshold_scale_factor_context/_generation or target_sparsity must be given"),
    ({"target_sparsity": 0.9, "threshold_scale_factor_context": 0.0,
      "calibration_points": {"generation": ((1.0, 0.0), (10.0, 0.5))}}, r"skip_softmax.target_sparsity for generation: target sparsity 0.9 is outside"),
    ({"target_sparsity": 0.5, "calibration": {"generation": (1.0, 1.0)}, "threshold_scale_factor_context": 0.0,
      "calibration_points": {"generation": ((1.0, 0.0), (10.0, 0.5))}}, r"skip_softmax.calibration_points must not repeat phase\(s\) \['generation'\]"),
    ({"threshold_scale_factor_generation": 1.0, "threshold_scale_factor_context": 0.0,
      "calibration_points": {"generation": ((-1.0, 0.0), (10.0, 0.5))}}, r"skip_softmax.calibration_points\['generation'\]: calibration points must be"),
    ({"threshold_scale_factor_generation": -1.0}, "threshold_scale_factor_generation must be >= 0"),
    ({"target_sparsity": 1.5, "calibration": {"generation": (1.0, 1.0), "context": (1.0, 1.0)}}, r"in \[0, 1\)"),
    ({"target_sparsity": 0.5}, "skip_softmax.target_sparsity needs calibration coefficients"),
    ({"target_sparsity": 0.5, "calibration": {"generation": (1, 1), "context": (1, 1), "x": (1, 1)}}, "skip_softmax.calibration keys must be in"),
])
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kvsieve.create_selector("skip_softmax", **kwargs)


def test_every_cpu_backend_skips_the_tiles_the_kernel_skips():
    """Through the engine: vanilla and torch skip exactly the tiles the Triton kernel skips."""
    k, v = peaked_context()
    q = k[:8].mean(0).repeat(4, 1).unsqueeze(0) * 0.3 + 0.1 * torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(1))
    params = {"threshold_scale_factor_generation": 1e4}
    ref, ref_st = decode_once(engine(params), k, v, q)
    assert ref_st.skipped_tiles > 0
    for backend in ("vanilla", "torch"):
        out, st = decode_once(engine(params, backend=backend), k, v, q)
        assert (st.skipped_tiles, st.walked_tiles) == (ref_st.skipped_tiles, ref_st.walked_tiles), backend
        torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
