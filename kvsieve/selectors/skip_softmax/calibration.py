"""The ``calibrate_skip_softmax`` calibration step of the ``skip_softmax`` selector: the decode-phase
skipped-tile fraction measured against the factor by :func:`.selector.calibrate_threshold` on the
model's own attention (the last query of each layer the entry runs on, over the whole context, on
``num_texts`` windows of ``length`` tokens of essay text), bisected around each target sparsity
of the entry; gives ``calibration_points: {generation: [(factor, fraction), ...]}``, which the
selector interpolates. The layers and the targets are part of the options (and so of the cache
key); the points are kept at the harness's cache stem (``.json``) and reused.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ...sparse.calibration import CalibrationContext, CalibrationStep, register_calibration_step
from ..common.text_windows import token_windows
from .selector import calibrate_threshold, interpolate_factor

__all__ = ["CalibrateSkipSoftmax"]


@register_calibration_step
class CalibrateSkipSoftmax(CalibrationStep):
    """The decode-phase factor of ``skip_softmax`` calibrated per target sparsity on the model's attention."""

    name = "calibrate_skip_softmax"
    selector = "skip_softmax"
    options = {"length": 2048, "num_texts": 2, "factors": [10.0 ** e for e in range(-1, 7)], "steps": 8}

    def resolve(self, options: dict[str, Any], ctx: CalibrationContext) -> dict[str, Any]:
        return options | {"layers": ctx.layers, "targets": list(ctx.sparsities)}

    def run(self, options: dict[str, Any], ctx: CalibrationContext, stem: Path) -> dict[str, Any]:
        path = stem.with_suffix(".json")
        if path.is_file():
            points = tuple(tuple(p) for p in json.loads(path.read_text(encoding="utf-8"))["points"])
            verb = f"reused the skip-softmax calibration of {ctx.model_name} ({path}"
        else:
            t0 = time.perf_counter()
            essays = [d for d in ctx.documents() if d.source == "essays"]
            windows = token_windows(ctx.tokenizer, essays, options["length"], options["num_texts"])
            samples, scale = ctx.last_queries(windows, set(options["layers"]))
            points = calibrate_threshold(samples, options["targets"], factors=tuple(options["factors"]),
                                         sm_scale=scale, steps=options["steps"])
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"model": ctx.model_name, **options, "points": [list(p) for p in points]},
                                      indent=2), encoding="utf-8")
            tmp.rename(path)
            verb = (f"calibrated skip-softmax for {ctx.model_name} in {time.perf_counter() - t0:.0f} s ({len(samples)} "
                    f"layer samples of layers {options['layers']}, saved to {path}")
        factors = ", ".join(f"{t} -> {interpolate_factor(points, t):.4g}" for t in options["targets"])
        ctx.log(f"{ctx.label}: {verb}; {len(points)} measured points; factor per target sparsity: {factors})")
        return {"calibration_points": {"generation": points}}
