"""Calibration steps: a selector family's offline, model-specific calibration, registered like a
selector.

Some selectors need something measured on the model before they run: DSA's indexer distilled
from the model's attention (:mod:`kvsieve.selectors.dsa.calibration`), skip-softmax's factors
calibrated on its scores (:mod:`kvsieve.selectors.skip_softmax.calibration`). The family registers
the step next to its selector; a harness (``kvsieve eval``, :mod:`kvsieve.eval.calibration`) looks it
up by name and calls it, knowing nothing about it::

    @register_calibration_step
    class MyCalibration(CalibrationStep):
        name = "calibrate_mine"          # what a sweep entry names in ``calibrate:``
        selector = "mine"                # the selector whose config it completes
        options = {"texts": 2}           # option -> default (``calibrate_params`` may set these only)

        def resolve(self, options, ctx):  # optional: add what the harness knows (keys the cache)
            return options | {"layers": ctx.layers}

        def run(self, options, ctx, stem):  # -> config fields of the selector
            ...
            return {"thresholds": ...}

The harness hands a :class:`CalibrationContext`: the frozen model and its tokenizer, a text corpus
(:class:`Document`), two ways of running the model that capture its attention (the model's own
RoPE, norms and scale), what the sweep entry will run (its layers, the context lengths, the
target sparsities) and a log. Selector code stays below the harness: whatever needs the model
framework comes in as these callables. ``stem`` is a cache path without suffix, unique to the
model's weights and the resolved options; a step keeps its result there and reuses it.

Third-party steps register in-process with the decorator, or by entry point::

    [project.entry-points."kvsieve.calibration_steps"]
    calibrate_mine = "my_pkg.calibration:MyCalibration"
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from .registry import Registry

__all__ = ["Document", "LayerCapture", "RowCapture", "LastQueryCapture", "CalibrationContext", "CalibrationStep",
           "CALIBRATION_STEPS", "CALIBRATION_ENTRY_POINT_GROUP", "register_calibration_step", "get_calibration_step",
           "available_calibration_steps"]


@dataclass(frozen=True)
class Document:
    """One text of the corpus a harness hands a calibration step: its ``source`` (``"essays"``: essays
    of the kind the eval's haystacks are made of; other names for other text), a ``name`` unique
    within the source, and the whitespace-normalised ``text``."""

    source: str
    name: str
    text: str


@dataclass(frozen=True)
class LayerCapture:
    """One layer of one window as its attention receives it: the attention-input ``hidden [S,
    hidden_size]`` (bf16), the queries of the chosen ``rows`` ``q [R, Hq, D]`` and every key
    ``k [S, Hkv, D]`` (fp32, RoPE and any norm applied) and the softmax ``scale``."""

    hidden: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    scale: float

    def dense_attention(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 ``[R, Hq, S]``: the causal softmax of each row's query heads over the keys."""
        k = self.k.repeat_interleave(self.q.shape[1] // self.k.shape[1], 1)
        s = torch.einsum("rhd,shd->rhs", self.q, k) * self.scale
        return torch.softmax(s.masked_fill((torch.arange(k.shape[0]) > rows[:, None])[:, None], float("-inf")), -1)


#: ``(ids [1, S], layers, rows [R]) -> {layer: LayerCapture}``: one forward pass of the frozen model
RowCapture = Callable[[torch.Tensor, list[int], torch.Tensor], dict[int, LayerCapture]]
#: ``(windows [[1, S], ...], layers) -> (samples, scale)``: per window and layer the last query
#: ``q [1, Hq, D]`` and every ``k``, ``v [S, Hkv, D]`` (fp32), and the layers' one softmax scale
LastQueryCapture = Callable[[list[torch.Tensor], set[int]],
                            tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], float]]


@dataclass(frozen=True)
class CalibrationContext:
    """What a harness hands a calibration step (module docstring).

    ``model``/``tokenizer``: the frozen model (a transformers causal LM) and its tokenizer;
    ``model_name``: a short name for logs and saved files; ``weights_hash()``: a digest of the
    weights (computed when asked); ``documents()``: the text corpus in a fixed order;
    ``capture`` / ``last_queries``: the model run once with its attention captured (:data:`RowCapture`,
    :data:`LastQueryCapture`). What the entry will run: ``layers`` (the layers its selector runs on;
    ``None``: the step's default), the context ``lengths`` and the target ``sparsities`` of its
    budgets. ``label`` names the entry in ``log`` lines.
    """

    model: torch.nn.Module
    tokenizer: Any
    model_name: str
    weights_hash: Callable[[], str]
    documents: Callable[[], list[Document]]
    capture: RowCapture
    last_queries: LastQueryCapture
    layers: list[int] | None = None
    lengths: tuple[int, ...] = ()
    sparsities: tuple[float, ...] = ()
    label: str = ""
    log: Callable[[str], None] = print


class CalibrationStep:
    """A selector family's calibration (module docstring). Subclasses set ``name``, ``selector``
    and ``options`` and override :meth:`run`; the harness instantiates the class without arguments."""

    name: ClassVar[str] = ""
    selector: ClassVar[str] = ""
    options: ClassVar[dict[str, Any]] = {}

    def resolve(self, options: dict[str, Any], ctx: CalibrationContext) -> dict[str, Any]:
        """``options`` (the defaults, then the entry's ``calibrate_params``) completed with what
        ``ctx`` tells (e.g. the layers); the result keys the cache and is what :meth:`run` gets."""
        return options

    def run(self, options: dict[str, Any], ctx: CalibrationContext, stem: Path) -> dict[str, Any]:
        """The config fields to add to the entry's selector params (e.g. ``{"projections": path}``);
        a result kept at ``stem`` (plus a suffix) is reused. ``ValueError``: the step cannot run."""
        raise NotImplementedError


def _check_step(cls: type) -> None:
    if not isinstance(cls.selector, str) or not cls.selector:
        raise ValueError(f"calibration step {cls.name!r} ({cls.__qualname__}) names no `selector` (a non-empty str)")
    if not isinstance(cls.options, dict):
        raise TypeError(f"calibration step {cls.name!r} ({cls.__qualname__}): `options` must be a dict of defaults")
    if cls.run is CalibrationStep.run:
        raise TypeError(f"calibration step {cls.name!r} ({cls.__qualname__}) does not override run")


CALIBRATION_ENTRY_POINT_GROUP = "kvsieve.calibration_steps"
CALIBRATION_STEPS: Registry[type[CalibrationStep]] = Registry("calibration_step", CalibrationStep,
                                                              CALIBRATION_ENTRY_POINT_GROUP, check=_check_step)


P = TypeVar("P", bound=type[CalibrationStep])


def register_calibration_step(cls: P) -> P:
    """Class decorator: register a calibration step under ``cls.name``."""
    return CALIBRATION_STEPS.register(cls)


def get_calibration_step(name: str) -> type[CalibrationStep]:
    return CALIBRATION_STEPS.get(name)


def available_calibration_steps() -> list[str]:
    """Names of the registered and entry-point calibration steps."""
    return CALIBRATION_STEPS.available()
