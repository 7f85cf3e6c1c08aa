"""Skip-softmax (BLASST, arXiv 2512.12087; TensorRT-LLM "skip softmax attention").

No indices: the selector hands the kernels a threshold. Inside the online-softmax loop a KV tile
is skipped (no exp, no V load, no P.V) when for every query row of the tile
``exp(tile_max - running_max) < lambda`` with ``lambda = threshold_scale_factor / kv_len``;
context (prefill) and generation (decode) rows have separate factors (0 = off). The kernels count
skipped tiles, so the achieved sparsity is measured, not promised.

Calibration: :func:`fit_threshold_formula` measures the skipped-tile fraction of captured
attention samples over a grid of factors and fits the published form
``factor = a * exp(b * target_sparsity)``; :class:`SkipSoftmaxConfig` resolves a
``target_sparsity`` through those coefficients (an explicit factor wins).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..metadata import PHASES
from ..sparse import Capabilities, SelectorInputs, SparseRuntimeParams, SparseSelector, register_selector
from ..sparse.knobs import check_knobs, knob

__all__ = ["SkipSoftmaxConfig", "SkipSoftmaxSelector", "measure_skip_fraction", "fit_threshold_formula",
           "ThresholdFit"]

PHASE_KEYS = PHASES  # ("context", "generation"): the phase names of the whole package


@dataclass(frozen=True)
class SkipSoftmaxConfig:
    """Either explicit factors, or ``target_sparsity`` plus ``calibration`` coefficients.

    ``calibration`` maps ``"context"``/``"generation"`` to ``(a, b)`` of ``a * exp(b * s)``.
    A phase with neither an explicit factor nor a calibrated target stays dense (factor 0).
    """

    threshold_scale_factor_context: float | None = knob(None, ge=0)
    threshold_scale_factor_generation: float | None = knob(None, ge=0)
    target_sparsity: float | None = knob(None, ge=0, lt=1)
    calibration: dict[str, tuple[float, float]] = knob(default_factory=dict)

    def __post_init__(self) -> None:
        check_knobs(self, "skip_softmax")
        if self.target_sparsity is not None:
            missing = [p for p in PHASE_KEYS if p not in self.calibration
                       and getattr(self, f"threshold_scale_factor_{p}") is None]
            if missing:
                raise ValueError(f"skip_softmax: target_sparsity needs calibration coefficients (a, b) for {missing} "
                                 "(see fit_threshold_formula) or an explicit factor")
        unknown = set(self.calibration) - set(PHASE_KEYS)
        if unknown:
            raise ValueError(f"skip_softmax: calibration keys must be in {list(PHASE_KEYS)}, got {sorted(unknown)}")
        if (self.threshold_scale_factor_context is None and self.threshold_scale_factor_generation is None
                and self.target_sparsity is None):
            raise ValueError("skip_softmax: give threshold_scale_factor_context/_generation or target_sparsity")

    def factor(self, phase: str) -> float:
        """The resolved factor of ``phase`` (``"context"`` or ``"generation"``)."""
        explicit = getattr(self, f"threshold_scale_factor_{phase}")
        if explicit is not None:
            return explicit
        if self.target_sparsity is None or phase not in self.calibration:
            return 0.0
        a, b = self.calibration[phase]
        return a * math.exp(b * self.target_sparsity)


@register_selector
class SkipSoftmaxSelector(SparseSelector):
    name = "skip_softmax"
    config_class = SkipSoftmaxConfig
    capabilities = Capabilities(attention_kinds=frozenset({"gqa", "mla"}))

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
    from ..kernels.triton.sparse_gqa_decode.naive import sparse_gqa_decode as decode_reference  # lazy: triton

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


@dataclass(frozen=True)
class ThresholdFit:
    """``factor = a * exp(b * sparsity)`` fitted on the measured ``(factor, sparsity)`` points."""

    a: float
    b: float
    points: tuple[tuple[float, float], ...]

    def factor_for(self, target_sparsity: float) -> float:
        return self.a * math.exp(self.b * target_sparsity)


def fit_threshold_formula(samples: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                          factors: Sequence[float] = tuple(10.0 ** e for e in range(-1, 7)),
                          sm_scale: float | None = None) -> ThresholdFit:
    """Measure sparsity at each factor and least-squares fit ``log(factor) = log(a) + b * s``.

    Points with sparsity 0 or 1 carry no slope information and are left out of the fit (they are
    kept in ``points``); at least two informative points are required.
    """
    if any(f <= 0 for f in factors):
        raise ValueError("fit_threshold_formula: factors must be > 0")
    points = tuple((float(f), measure_skip_fraction(samples, f, sm_scale)) for f in factors)
    used = [(math.log(f), s) for f, s in points if 0.0 < s < 1.0]
    if len(used) < 2 or len({s for _, s in used}) < 2:
        raise ValueError(f"fit_threshold_formula: need >= 2 factors with distinct sparsity in (0, 1); measured {points}")
    n = len(used)
    mean_s = sum(s for _, s in used) / n
    mean_y = sum(y for y, _ in used) / n
    b = sum((s - mean_s) * (y - mean_y) for y, s in used) / sum((s - mean_s) ** 2 for _, s in used)
    return ThresholdFit(a=math.exp(mean_y - b * mean_s), b=b, points=points)
