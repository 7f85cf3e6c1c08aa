"""The ``distill_indexer`` calibration step of the ``dsa`` selector: the indexer distilled for the model
(:func:`.distill.distill`, options :class:`~.distill_config.DistillConfig`) on the layers the entry
runs on; ``seq_len: 0`` trains at the sweep's longest context length, a list of lengths (``seq_len:
[4096, 8192, 16384]``) one indexer on windows of each. Gives ``projections`` (the
file) and the indexer geometry ``n_heads``/``head_dim``/``rope_dim``/``rope_theta``. The file is
kept at the harness's cache stem (``.pt``) and reused.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ...sparse.calibration import CalibrationContext, CalibrationStep, register_calibration_step
from .distill_config import DistillConfig
from .projections import load_projections, save_projections

__all__ = ["DistillIndexer"]


@register_calibration_step
class DistillIndexer(CalibrationStep):
    """The ``dsa`` indexer distilled from the model's dense attention, on the layers the entry runs on."""

    name = "distill_indexer"
    selector = "dsa"
    options = dataclasses.asdict(DistillConfig()) | {"seq_len": 0}

    def resolve(self, options: dict[str, Any], ctx: CalibrationContext) -> dict[str, Any]:
        seq_len = max(ctx.lengths) if options["seq_len"] == 0 else options["seq_len"]  # [] is refused, not 0
        return options | {"layers": ctx.layers, "seq_len": seq_len}

    def run(self, options: dict[str, Any], ctx: CalibrationContext, stem: Path) -> dict[str, Any]:
        from .distill import distill, result_meta, rope_theta

        path = stem.with_suffix(".pt")
        geometry = {k: options[k] for k in ("n_heads", "head_dim", "rope_dim")}
        geometry["rope_theta"] = rope_theta(getattr(ctx.model.config, "text_config", ctx.model.config))
        if path.is_file():
            _, meta = load_projections(str(path))
            last = meta["curve"][-1]
            ctx.log(f"{ctx.label}: reused the DSA indexer distilled for {ctx.model_name} ({path}; held-out KL "
                    f"{meta['curve'][0]['heldout_kl']:.3f} -> {last['heldout_kl']:.3f})")
            return {"projections": str(path), **geometry}
        cfg = DistillConfig(**{f.name: options[f.name] for f in dataclasses.fields(DistillConfig)})
        result = distill(ctx, cfg, progress=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_projections(str(tmp), result.projections, result_meta(result, cfg, ctx.model_name) | {"options": options})
        tmp.rename(path)
        first, last = result.curve[0], result.curve[-1]
        ctx.log(f"{ctx.label}: trained a DSA indexer for {ctx.model_name} on layers {options['layers']} in "
                f"{last.seconds:.0f} s ({last.cpu_seconds:.0f} s CPU; held-out KL {first.heldout_kl:.3f} -> "
                f"{last.heldout_kl:.3f}), saved to {path}")
        return {"projections": str(path), **geometry}
