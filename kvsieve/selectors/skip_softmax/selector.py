"""Skip-softmax (BLASST, arXiv 2512.12087; TensorRT-LLM "skip softmax attention").

No indices: the selector hands the kernels a threshold. Inside the online-softmax loop a KV tile
is skipped (no exp, no V load, no P.V) when for every query row of the tile
``exp(tile_max - running_max) < lambda`` with ``lambda = threshold_scale_factor / kv_len``;
context (prefill) and generation (decode) rows have separate factors (0 = off). The kernels count
skipped tiles, so the achieved sparsity is measured, not promised.

Calibration: :class:`SkipSoftmaxConfig` resolves a ``target_sparsity`` (an explicit factor wins)
through the published form ``factor = a * exp(b * target_sparsity)`` with given coefficients
(``calibration``), or through :func:`calibrate_threshold`, which measures the skipped-tile
fraction of captured attention samples, bisects the factor (in log space) around each target
sparsity and keeps the measured points (``calibration_points``): the factor of a target is
interpolated between the two measured points that bracket it, and a target outside the measured
range is refused. (A least-squares fit of the published form missed badly on a model whose
skipped fraction jumps within one decade of factors, Gemma 3 at 8K: 0.75 asked, 0.99 skipped.)
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...metadata import PHASES
from ...sparse import BudgetKnob, Capabilities, SelectorInputs, SparseRuntimeParams, SparseSelector, register_selector
from ...sparse.knobs import KnobError, check_knobs, knob

__all__ = ["SkipSoftmaxConfig", "SkipSoftmaxSelector", "measure_skip_fraction", "calibrate_threshold",
           "interpolate_factor"]

PHASE_KEYS = PHASES  # ("context", "generation"): the phase names of the whole package


@dataclass(frozen=True)
class SkipSoftmaxConfig:
    """Either explicit factors, or ``target_sparsity`` plus a calibration per phase.

    ``calibration`` maps ``"context"``/``"generation"`` to ``(a, b)`` of ``a * exp(b * s)``;
    ``calibration_points`` maps a phase to measured ``(factor, skipped fraction)`` points
    (:func:`calibrate_threshold`), interpolated by :func:`interpolate_factor`. A phase takes one
    of the two. A phase with neither an explicit factor nor a calibrated target stays dense
    (factor 0).
    """

    threshold_scale_factor_context: float | None = knob(None, ge=0)
    threshold_scale_factor_generation: float | None = knob(None, ge=0)
    target_sparsity: float | None = knob(None, ge=0, lt=1)
    calibration: dict[str, tuple[float, float]] = knob(default_factory=dict)
    calibration_points: dict[str, tuple[tuple[float, float], ...]] = knob(default_factory=dict)

    def __post_init__(self) -> None:
        check_knobs(self, "skip_softmax")
        both = set(self.calibration) & set(self.calibration_points)
        if both:
            raise KnobError(f"skip_softmax.calibration_points must not repeat phase(s) {sorted(both)} of "
                            "calibration (give each phase one of the two)")
        if self.target_sparsity is not None:
            missing = [p for p in PHASE_KEYS if p not in self.calibration and p not in self.calibration_points
                       and getattr(self, f"threshold_scale_factor_{p}") is None]
            if missing:
                raise KnobError(f"skip_softmax.target_sparsity needs calibration coefficients (a, b) or "
                                f"calibration_points for {missing} (see calibrate_threshold) "
                                "or an explicit factor")
        unknown = (set(self.calibration) | set(self.calibration_points)) - set(PHASE_KEYS)
        if unknown:
            raise KnobError(f"skip_softmax.calibration keys must be in {list(PHASE_KEYS)}, got {sorted(unknown)}")
        for phase, points in self.calibration_points.items():
            try:
                _bracket_points(points)  # malformed points are refused even without a target
            except ValueError as err:
                raise KnobError(f"skip_softmax.calibration_points[{phase!r}]: {err}") from None
            self.factor(phase)  # a target outside the measured points is refused here
        if (self.threshold_scale_factor_context is None and self.threshold_scale_factor_generation is None
                and self.target_sparsity is None):
            raise KnobError("skip_softmax.threshold_scale_factor_context/_generation or target_sparsity must be given")

    def factor(self, phase: str) -> float:
        """The resolved factor of ``phase`` (``"context"`` or ``"generation"``)."""
        explicit = getattr(self, f"threshold_scale_factor_{phase}")
        if explicit is not None:
            return explicit
        if self.target_sparsity is None:
            return 0.0
        if phase in self.calibration_points:
            try:
                return interpolate_factor(self.calibration_points[phase], self.target_sparsity)
            except ValueError as err:
                raise KnobError(f"skip_softmax.target_sparsity for {phase}: {err}") from None
        if phase not in self.calibration:
            return 0.0
        a, b = self.calibration[phase]
        return a * math.exp(b * self.target_sparsity)


@register_selector
class SkipSoftmaxSelector(SparseSelector):
    name = "skip_softmax"
    config_class = SkipSoftmaxConfig
    capabilities = Capabilities(attention_kinds=frozenset({"gqa", "mla"}), skip_softmax=True, per_kv_head=True)
    budget = BudgetKnob("target_sparsity", unit="sparsity")  # a calibrated target; the kernels measure it

    def predict_attn(self, inputs: SelectorInputs) -> SparseRuntimeParams:
        return SparseRuntimeParams(threshold_scale_factor_context=self.config.factor("context"),
                                   threshold_scale_factor_generation=self.config.factor("generation"))


def measure_skip_fraction(samples: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], factor: float,
                          sm_scale: float | None = None) -> float:
    """Skipped / walked KV tiles of decode attention over ``samples`` at ``factor``.

    Each sample is ``(q [T, Hq, D], k [L, Hkv, D], v [L, Hkv, D])``: ``T`` queries that each see
    all ``L`` keys (decode against a captured context). Uses the kernels' plain-PyTorch reference,
    which walks the same tiles as the Triton kernel.
    """
    from ...kernels.sparse_gqa_decode.naive import sparse_gqa_decode as decode_reference

    skipped = walked = 0
    for q, k, v in samples:
        length, hkv, d = k.shape
        pool_k = torch.zeros(2, hkv, length, d, dtype=torch.float32)
        pool_v = torch.zeros(2, hkv, length, v.shape[-1], dtype=torch.float32)
        pool_k[1], pool_v[1] = k.float().transpose(0, 1), v.float().transpose(0, 1)
        t = q.shape[0]
        stats = torch.zeros(2, dtype=torch.int64)
        decode_reference(q.float(), pool_k, pool_v, torch.ones(1, 1, dtype=torch.int32),
                         torch.zeros(t, dtype=torch.int32), torch.full((t,), length, dtype=torch.int32),
                         sm_scale=sm_scale, threshold_scale_factor=factor, stats=stats, num_splits=1)
        skipped, walked = skipped + int(stats[0]), walked + int(stats[1])
    if walked == 0:
        raise ValueError("measure_skip_fraction: samples contain no KV tiles")
    return skipped / walked


def interpolate_factor(points: Sequence[tuple[float, float]], target_sparsity: float) -> float:
    """The factor whose skipped fraction is ``target_sparsity`` on measured ``(factor, fraction)``
    points: sorted by factor, the first two neighbours whose fractions bracket the target, linear
    in ``log(factor)`` between them (the fraction grows with the factor, though not always
    strictly: a skipped tile does not raise the running max). A target outside the measured
    fractions is refused (``ValueError``)."""
    (f0, s0), (f1, s1) = _first_bracket(_bracket_points(points), target_sparsity)
    if s1 == s0:
        return f0
    t = (target_sparsity - s0) / (s1 - s0)
    return math.exp(math.log(f0) + t * (math.log(f1) - math.log(f0)))


def _bracket_points(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    pts = sorted((float(f), float(s)) for f, s in points)
    if not pts or any(f <= 0 or not 0.0 <= s <= 1.0 for f, s in pts):
        raise ValueError(f"calibration points must be (factor > 0, fraction in [0, 1]) pairs, got {list(points)}")
    return pts


def _first_bracket(pts: list[tuple[float, float]], target: float
                   ) -> tuple[tuple[float, float], tuple[float, float]]:
    """The first neighbours ``(f0, s0), (f1, s1)`` of ``pts`` (sorted by factor) with
    ``s0 <= target <= s1``; a single point equal to the target is its own bracket. A target
    outside the measured fractions is refused (``ValueError`` listing the points)."""
    for a, b in zip(pts, pts[1:]):
        if a[1] <= target <= b[1]:
            return a, b
    exact = [p for p in pts if p[1] == target]
    if exact:
        return exact[0], exact[0]
    raise ValueError(f"target sparsity {target} is outside the measured skipped fractions "
                     f"[{min(s for _, s in pts):.4f}, {max(s for _, s in pts):.4f}] at factors {pts[0][0]:.4g} "
                     f"to {pts[-1][0]:.4g}: {[(f, round(s, 4)) for f, s in pts]}")


def calibrate_threshold(samples: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                        targets: Sequence[float], *,
                        factors: Sequence[float] = tuple(10.0 ** e for e in range(-1, 7)),
                        sm_scale: float | None = None, steps: int = 8) -> tuple[tuple[float, float], ...]:
    """Measured ``(factor, skipped fraction)`` points (sorted by factor) that bracket every target
    sparsity tightly: the skipped fraction of ``samples`` (as :func:`measure_skip_fraction`) at
    each of ``factors``, then ``steps`` bisections in ``log(factor)`` of the bracket around each
    target (a bracket of one decade narrows to ``10 ** (1 / 2 ** steps)``). A target above the
    largest or below the smallest measured fraction is refused (``ValueError``)."""
    if any(f <= 0 for f in factors):
        raise ValueError("calibrate_threshold: factors must be > 0")
    measured = {float(f): measure_skip_fraction(samples, f, sm_scale) for f in factors}
    for target in targets:
        for _ in range(steps):
            try:
                (f0, s0), (f1, s1) = _first_bracket(sorted(measured.items()), target)
            except ValueError as err:
                raise ValueError(f"calibrate_threshold: {err}") from None
            if f0 == f1 or s0 == target or s1 == target:
                break
            mid = math.sqrt(f0 * f1)
            measured[mid] = measure_skip_fraction(samples, mid, sm_scale)
    return tuple(sorted(measured.items()))
