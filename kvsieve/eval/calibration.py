"""Model-specific calibration of a selector entry, run once per model before the sweep.

A selectors entry may name ``calibrate`` (with options in ``calibrate_params``): a calibration step that
the entry's selector family registers (:mod:`kvsieve.sparse.calibration`; ``kvsieve list calibration``
lists them). The sweep runs that step for the eval model and merges its result (config fields)
into the entry's ``params``. The step gets a :class:`~kvsieve.sparse.CalibrationContext`: the model
and tokenizer, the text corpus (:mod:`.text_corpus`), the model's attention captures
(:mod:`.attention_capture`), the layers the entry runs its selector on (its ``layers`` /
``layer_types`` / ``dense_layers``, by default the full-attention layers of a model that
interleaves layer types), the sweep's context lengths and the entry's target sparsities.

The texts start with the tokenizer's special prefix (Gemma's ``<bos>``), as the eval's prompts
do; a non-empty prefix is added to the options as ``special_prefix``. Each result is cached under
``$KVSIEVE_CACHE/prepared/`` (default ``~/.cache/kvsieve``; the folder keeps its first name, so the
results kept there stay found), keyed by a sha256 of the model's weights and of the step's resolved
options, and reused; the step's log line says whether it ran or reused its kept result, and where
that is.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..cache_dir import default_cache_dir
from ..selectors.common.text_windows import special_prefix
from ..sparse.calibration import CalibrationContext, get_calibration_step
from .attention_capture import capture_attention, last_query_capture
from .config import ConfigError, EvalConfig, SelectorSpec
from .model import LoadedModel, model_hash
from .text_corpus import corpus_documents

__all__ = ["model_context", "calibrate_selectors", "calibration_dir"]


def calibration_dir() -> Path:
    """``prepared/`` (its first name, kept so the results cached there stay found) under
    :func:`kvsieve.cache_dir.default_cache_dir`."""
    return default_cache_dir() / "prepared"


def model_context(lm: LoadedModel, **fields: Any) -> CalibrationContext:
    """The :class:`CalibrationContext` of ``lm``: its model and tokenizer, the eval's corpus and the
    model's attention captures, plus ``fields`` (``layers``, ``lengths``, ``sparsities``, ...)."""
    return CalibrationContext(model=lm.model, tokenizer=lm.tokenizer, model_name=lm.name,
                          weights_hash=functools.partial(model_hash, lm.model), documents=corpus_documents,
                          capture=functools.partial(capture_attention, lm.model),
                          last_queries=functools.partial(last_query_capture, lm.model), **fields)


def calibrate_selectors(cfg: EvalConfig, lm: LoadedModel, log: Callable[[str], None] = print) -> EvalConfig:
    """``cfg`` with each entry that names ``calibrate`` completed for ``lm`` (module docstring); the
    completed entry's selector config is checked before any run."""
    from ..sparse import create_selector

    if not any(s.calibrate for s in cfg.selectors):
        return cfg
    digest = model_hash(lm.model)
    prefix = special_prefix(lm.tokenizer)  # the samples start with it, as the eval's prompts do
    lengths = tuple(sorted({n for t in cfg.tasks for n in t.lengths}))
    specs = []
    for s in cfg.selectors:
        if s.calibrate is not None:
            step = get_calibration_step(s.calibrate)()
            options = dict(step.options) | s.calibrate_params
            if prefix:  # part of the cache key
                options["special_prefix"] = prefix
            ctx = model_context(lm, layers=_planned_layers(lm, s), lengths=lengths, label=s.label,
                                sparsities=tuple(sorted({b.sparsity for n in lengths for b in s.resolve(n)})),
                                log=lambda line: log(f"kvsieve eval: {line}"))
            try:
                options = step.resolve(options, ctx)
                key = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:12]
                extra = step.run(options, ctx, calibration_dir() / f"{s.calibrate}-{lm.name}-{digest}-{key}")
            except ValueError as err:
                raise ConfigError(f"selectors.{s.label}.calibrate ({s.calibrate}) failed for {lm.name}: {err}"
                                  ) from None
            s = dataclasses.replace(s, params=s.params | extra)
            try:
                for budget in s.resolve(min(lengths)):
                    create_selector(s.selector, **s.sparse_config(budget).params)
            except (TypeError, ValueError) as err:
                raise ConfigError(f"selectors.{s.label}: {err}") from None
        specs.append(s)
    return dataclasses.replace(cfg, selectors=specs)


def _planned_layers(lm: LoadedModel, spec: SelectorSpec) -> list[int]:
    """The layers ``spec`` runs its selector on in ``lm``, as the session's plan resolves them."""
    from ..sparse.sparse_layers import sparse_layers

    cfg = lm.model.config
    cfg = getattr(cfg, "text_config", cfg)
    return sorted(sparse_layers(num_layers=cfg.num_hidden_layers, model_layer_types=getattr(cfg, "layer_types", None),
                                layers=spec.layers, layer_types=spec.layer_types, dense_layers=spec.dense_layers))
