"""Prepare steps: a selector family's model-specific preparation, registered like a selector.

Some selectors need something measured on the model before they run: DSA's indexer distilled
from the model's attention (:mod:`kvsieve.selectors.dsa.prepare`), skip-softmax's factors
calibrated on its scores (:mod:`kvsieve.selectors.skip_softmax.prepare`). The family registers
the step next to its selector; a harness (``kvsieve eval``, :mod:`kvsieve.eval.prepare`) looks it
up by name and calls it, knowing nothing about it::

    @register_prepare_step
    class MyCalibration(PrepareStep):
        name = "calibrate_mine"          # what a sweep entry names in ``prepare:``
        selector = "mine"                # the selector whose config it completes
        options = {"texts": 2}           # option -> default (``prepare_params`` may set these only)

        def resolve(self, options, ctx):  # optional: add what the harness knows (keys the cache)
            return options | {"layers": ctx.layers}

        def run(self, options, ctx, stem):  # -> config fields of the selector
            ...
            return {"thresholds": ...}

The harness hands a :class:`PrepareContext`: the frozen model and its tokenizer, a text corpus
(:class:`Document`), two ways of running the model that capture its attention (the model's own
RoPE, norms and scale), what the sweep entry will run (its layers, the context lengths, the
target sparsities) and a log. Selector code stays below the harness: whatever needs the model
framework comes in as these callables. ``stem`` is a cache path without suffix, unique to the
model's weights and the resolved options; a step keeps its result there and reuses it.

Third-party steps register in-process with the decorator, or by entry point::

    [project.entry-points."kvsieve.prepare_steps"]
    calibrate_mine = "my_pkg.prepare:MyCalibration"
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from .registry import Registry

__all__ = ["Document", "LayerCapture", "RowCapture", "LastQueryCapture", "PrepareContext", "PrepareStep",
           "PREPARE_STEPS", "PREPARE_ENTRY_POINT_GROUP", "register_prepare_step", "get_prepare_step",
           "available_prepare_steps"]


@dataclass(frozen=True)
class Document:
    """One text of the corpus a harness hands a prepare step: its ``source`` (``"essays"``: essays
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
class PrepareContext:
    """What a harness hands a prepare step (module docstring).

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


class PrepareStep:
    """A selector family's preparation (module docstring). Subclasses set ``name``, ``selector``
    and ``options`` and override :meth:`run`; the harness instantiates the class without arguments."""

    name: ClassVar[str] = ""
    selector: ClassVar[str] = ""
    options: ClassVar[dict[str, Any]] = {}

    def resolve(self, options: dict[str, Any], ctx: PrepareContext) -> dict[str, Any]:
        """``options`` (the defaults, then the entry's ``prepare_params``) completed with what
        ``ctx`` tells (e.g. the layers); the result keys the cache and is what :meth:`run` gets."""
        return options

    def run(self, options: dict[str, Any], ctx: PrepareContext, stem: Path) -> dict[str, Any]:
        """The config fields to add to the entry's selector params (e.g. ``{"projections": path}``);
        a result kept at ``stem`` (plus a suffix) is reused. ``ValueError``: the step cannot run."""
        raise NotImplementedError


def _check_step(cls: type) -> None:
    if not isinstance(cls.selector, str) or not cls.selector:
        raise ValueError(f"prepare step {cls.name!r} ({cls.__qualname__}) names no `selector` (a non-empty str)")
    if not isinstance(cls.options, dict):
        raise TypeError(f"prepare step {cls.name!r} ({cls.__qualname__}): `options` must be a dict of defaults")
    if cls.run is PrepareStep.run:
        raise TypeError(f"prepare step {cls.name!r} ({cls.__qualname__}) does not override run")


PREPARE_ENTRY_POINT_GROUP = "kvsieve.prepare_steps"
PREPARE_STEPS: Registry[type[PrepareStep]] = Registry("prepare_step", PrepareStep, PREPARE_ENTRY_POINT_GROUP,
                                                      check=_check_step)


P = TypeVar("P", bound=type[PrepareStep])


def register_prepare_step(cls: P) -> P:
    """Class decorator: register a prepare step under ``cls.name``."""
    return PREPARE_STEPS.register(cls)


def get_prepare_step(name: str) -> type[PrepareStep]:
    return PREPARE_STEPS.get(name)


def available_prepare_steps() -> list[str]:
    """Names of the registered and entry-point prepare steps."""
    return PREPARE_STEPS.available()
