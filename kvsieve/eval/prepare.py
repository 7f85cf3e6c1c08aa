"""Model-specific preparation of a selector entry, run once per model before the sweep.

A selectors entry may name ``prepare`` (with options in ``prepare_params``); the sweep then runs
that step for the eval model and merges its result into the entry's ``params``:

* ``distill_indexer`` (``dsa``): the DSA indexer distilled for the model
  (:func:`kvsieve.eval.distill_indexer.distill`, options :class:`~.distill_config.DistillConfig`)
  on the layers the entry runs on; ``seq_len: 0`` trains at the sweep's longest task length.
  Gives ``projections`` (the file) and the indexer geometry ``n_heads``/``head_dim``/
  ``rope_dim``/``rope_theta``.
* ``calibrate_skip_softmax`` (``skip_softmax``): the decode-phase skipped-tile fraction measured
  against the factor by :func:`kvsieve.selectors.skip_softmax.selector.calibrate_threshold` on the model's
  own attention (the last query of each layer the entry runs on — its ``layers`` /
  ``layer_types`` / ``dense_layers``, by default the full-attention layers of a model that
  interleaves layer types — over the whole context, on essay text), bisected around each target
  sparsity of the entry; gives ``calibration_points: {generation: [(factor, fraction), ...]}``,
  which the selector interpolates. The layers and the targets are part of the cache key.

Both read essay sequences that start with the tokenizer's special prefix (Gemma's ``<bos>``), as
the eval's prompts do; a non-empty prefix is part of the cache key.

Each result is cached under ``$KVSIEVE_CACHE/prepared/`` (default ``~/.cache/kvsieve``), keyed
by a sha256 of the model's weights and of the step's options, and reused; the sweep prints
whether it trained/calibrated or reused, and where the file is.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .config import PREPARE_OPTIONS, ConfigError, EvalConfig, SelectorSpec
from .distill_corpus import special_prefix
from .distill_config import DistillConfig
from ..cache_dir import default_cache_dir
from .model import LoadedModel, model_hash

__all__ = ["last_query_samples", "prepare_selectors", "prepared_dir"]

_CAPTURE = "kvsieve_capture"


def prepared_dir() -> Path:
    """``prepared/`` under :func:`kvsieve.cache_dir.default_cache_dir`."""
    return default_cache_dir() / "prepared"


def prepare_selectors(cfg: EvalConfig, lm: LoadedModel, log: Callable[[str], None] = print) -> EvalConfig:
    """``cfg`` with each entry that names ``prepare`` completed for ``lm`` (module docstring); the
    completed entry's selector config is checked before any run."""
    from ..sparse import create_selector

    if not any(s.prepare for s in cfg.selectors):
        return cfg
    digest = model_hash(lm.model)
    prefix = special_prefix(lm.tokenizer)  # the samples start with it, as the eval's prompts do
    specs = []
    for s in cfg.selectors:
        if s.prepare is not None:
            options = PREPARE_OPTIONS[s.prepare] | s.prepare_params
            if prefix:  # part of the cache key
                options["special_prefix"] = prefix
            if s.prepare == "distill_indexer":
                options["layers"] = _planned_layers(lm, s)
                options["seq_len"] = options["seq_len"] or max(n for t in cfg.tasks for n in t.lengths)
            if s.prepare == "calibrate_skip_softmax":
                options["layers"] = _planned_layers(lm, s)
                options["targets"] = sorted({b.sparsity for t in cfg.tasks for n in t.lengths for b in s.resolve(n)})
            key = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:12]
            step = _distill if s.prepare == "distill_indexer" else _calibrate
            try:
                extra = step(lm, options, prepared_dir() / f"{s.prepare}-{lm.name}-{digest}-{key}", s.label, log)
            except ValueError as err:
                raise ConfigError(f"selectors.{s.label}.prepare ({s.prepare}) failed for {lm.name}: {err}") from None
            s = dataclasses.replace(s, params=s.params | extra)
            try:
                for budget in s.resolve(min(n for t in cfg.tasks for n in t.lengths)):
                    create_selector(s.selector, **s.sparse_config(budget).params)
            except (TypeError, ValueError) as err:
                raise ConfigError(f"selectors.{s.label}: {err}") from None
        specs.append(s)
    return dataclasses.replace(cfg, selectors=specs)


def _distill(lm: LoadedModel, options: dict[str, Any], stem: Path, label: str,
             log: Callable[[str], None]) -> dict[str, Any]:
    from ..selectors.dsa.projections import load_projections, save_projections
    from .distill_indexer import _rope_theta, distill, result_meta

    path = stem.with_suffix(".pt")
    geometry = {k: options[k] for k in ("n_heads", "head_dim", "rope_dim")}
    geometry["rope_theta"] = _rope_theta(getattr(lm.model.config, "text_config", lm.model.config))
    if path.is_file():
        _, meta = load_projections(str(path))
        last = meta["curve"][-1]
        log(f"kvsieve eval: {label}: reused the DSA indexer distilled for {lm.name} ({path}; held-out KL "
            f"{meta['curve'][0]['heldout_kl']:.3f} -> {last['heldout_kl']:.3f})")
        return {"projections": str(path), **geometry}
    cfg = DistillConfig(**{f.name: options[f.name] for f in dataclasses.fields(DistillConfig)})
    result = distill(lm.model, lm.tokenizer, cfg, options["layers"], progress=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_projections(str(tmp), result.projections, result_meta(result, cfg, lm.name) | {"options": options})
    tmp.rename(path)
    first, last = result.curve[0], result.curve[-1]
    log(f"kvsieve eval: {label}: trained a DSA indexer for {lm.name} on layers {options['layers']} in "
        f"{last.seconds:.0f} s ({last.cpu_seconds:.0f} s CPU; held-out KL {first.heldout_kl:.3f} -> "
        f"{last.heldout_kl:.3f}), saved to {path}")
    return {"projections": str(path), **geometry}


def _calibrate(lm: LoadedModel, options: dict[str, Any], stem: Path, label: str,
               log: Callable[[str], None]) -> dict[str, Any]:
    from ..selectors.skip_softmax.selector import calibrate_threshold, interpolate_factor

    path = stem.with_suffix(".json")
    if path.is_file():
        points = tuple(tuple(p) for p in json.loads(path.read_text(encoding="utf-8"))["points"])
        verb = f"reused the skip-softmax calibration of {lm.name} ({path}"
    else:
        t0 = time.perf_counter()
        samples, scale = last_query_samples(lm, options["length"], options["num_texts"], set(options["layers"]))
        points = calibrate_threshold(samples, options["targets"], factors=tuple(options["factors"]),
                                     sm_scale=scale, steps=options["steps"])
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"model": lm.name, **options, "points": [list(p) for p in points]}, indent=2),
                       encoding="utf-8")
        tmp.rename(path)
        verb = (f"calibrated skip-softmax for {lm.name} in {time.perf_counter() - t0:.0f} s ({len(samples)} layer "
                f"samples of layers {options['layers']}, saved to {path}")
    factors = ", ".join(f"{t} -> {interpolate_factor(points, t):.4g}" for t in options["targets"])
    log(f"kvsieve eval: {label}: {verb}; {len(points)} measured points; factor per target sparsity: {factors})")
    return {"calibration_points": {"generation": points}}


def _planned_layers(lm: LoadedModel, spec: SelectorSpec) -> list[int]:
    """The layers ``spec`` runs its selector on in ``lm``, as the session's plan resolves them."""
    from ..sparse.sparse_layers import sparse_layers

    cfg = lm.model.config
    cfg = getattr(cfg, "text_config", cfg)
    return sorted(sparse_layers(num_layers=cfg.num_hidden_layers, model_layer_types=getattr(cfg, "layer_types", None),
                                layers=spec.layers, layer_types=spec.layer_types, dense_layers=spec.dense_layers))


def last_query_samples(lm: LoadedModel, length: int, num_texts: int, layers: set[int]
                    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], float]:
    """Per layer in ``layers`` and text, the last query over the whole context: ``(q [1, Hq, D],
    k [L, Hkv, D], v [L, Hkv, D])`` as the model's attention function receives them (after RoPE
    and any norm); and those layers' softmax scale (one value; layers that differ are refused)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from .distill_corpus import corpus_documents, token_windows

    samples, scales = [], set()

    def capture(module, query, key, value, attention_mask, **kwargs):
        if getattr(module, "layer_idx", None) is None:
            raise ValueError(f"calibrate_skip_softmax: attention module {type(module).__name__} has no layer_idx")
        if module.layer_idx not in layers:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        samples.append((query[0, :, -1:].transpose(0, 1).float(), key[0].transpose(0, 1).float(),
                        value[0].transpose(0, 1).float()))
        scales.add(float(kwargs["scaling"]) if kwargs.get("scaling") is not None else query.shape[-1] ** -0.5)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(_CAPTURE, capture)
    AttentionMaskInterface.register(_CAPTURE, sdpa_mask)
    model = lm.model
    previous = model.config._attn_implementation
    model.set_attn_implementation(_CAPTURE)
    try:
        with torch.no_grad():
            essays = [d for d in corpus_documents() if d.source == "essays"]
            for ids in token_windows(lm.tokenizer, essays, length, num_texts):
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        model.set_attn_implementation(previous)
    if len(scales) != 1:
        raise ValueError(f"calibrate_skip_softmax: the layers use different softmax scales {sorted(scales)}")
    return samples, scales.pop()
