"""One budget vocabulary: a selector names its budget knob and the unit the knob counts once, on
its class (``budget = BudgetKnob(...)``, beside ``capabilities``), and :func:`lower_budget` is the
one place that turns a budget in tokens, or a density of the context, into that knob's value::

    @register_selector
    class BlockSelectSelector(SparseSelector):
        budget = BudgetKnob("topk_blocks", unit="blocks", unit_size_field="block_size")

Units: ``tokens`` (the knob is a token count; with ``unit_size_field`` it is attended in whole
units of that many tokens, e.g. Quest's ``budget`` in pages of ``page_size``), ``pages`` or
``blocks`` (the knob counts units of ``unit_size_field`` tokens) and ``sparsity`` (the knob is the
fraction of the context not attended, e.g. skip-softmax's ``target_sparsity``). A selector with
no budget declares ``budget = None`` (the default), and a budget given for it is refused.

Rounding (:func:`lower_budget`): a density ``1 - sparsity`` (or ``1 / reduction_factor``) of ``L``
tokens asks ``ceil(L * density)`` tokens, attended as the most whole units within them; an
explicit token budget must be a whole number of units. A budget that cannot be honoured (no whole
unit, not a whole number of units, an unknown unit) is an error naming the selector and its knob,
never clamped.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .knobs import KnobError

__all__ = ["BudgetKnob", "LoweredBudget", "BUDGET_UNITS", "lower_budget"]

#: what a budget knob counts (see the module docstring)
BUDGET_UNITS = ("tokens", "pages", "blocks", "sparsity")


@dataclass(frozen=True)
class BudgetKnob:
    """A selector's budget knob: the config ``field`` that receives the budget, the ``unit`` it
    counts (:data:`BUDGET_UNITS`) and ``unit_size_field``, the config field holding the tokens of
    one page or block (required for ``pages``/``blocks``; optional for ``tokens``, where it makes
    the budget whole units of that size; none for ``sparsity``)."""

    field: str
    unit: str = "tokens"
    unit_size_field: str | None = None

    def __post_init__(self) -> None:
        if self.unit not in BUDGET_UNITS:
            raise ValueError(f"BudgetKnob.unit must be one of {list(BUDGET_UNITS)}, got {self.unit!r}")
        if self.unit in ("pages", "blocks") and self.unit_size_field is None:
            raise ValueError(f"BudgetKnob({self.field!r}, unit={self.unit!r}) needs unit_size_field, the config "
                             "field holding the tokens of one unit")
        if self.unit == "sparsity" and self.unit_size_field is not None:
            raise ValueError(f"BudgetKnob({self.field!r}, unit='sparsity') counts no units; got "
                             f"unit_size_field={self.unit_size_field!r}")

    def check_fields(self, config_class: type, owner: str) -> None:
        """Raise ``ValueError`` naming ``owner`` unless both fields are fields of ``config_class``."""
        names = {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()
        for what in (self.field, self.unit_size_field):
            if what is not None and what not in names:
                raise ValueError(f"selector {owner!r} declares budget knob field {what!r}, which its config "
                                 f"{config_class.__name__} does not have; fields: {sorted(names)}")

    def describe(self) -> str:
        """A few words for listings, e.g. ``topk_blocks (blocks of block_size tokens)``."""
        if self.unit == "sparsity":
            return f"{self.field} (sparsity: the fraction of the context not attended)"
        if self.unit_size_field is None:
            return f"{self.field} (tokens)"
        whole = "in whole units of" if self.unit == "tokens" else "of"
        return f"{self.field} ({self.unit} {whole} {self.unit_size_field} tokens)"


@dataclass(frozen=True)
class LoweredBudget:
    """A budget at one context length: ``tokens`` attended per query (whole units),
    ``sparsity = max(0, 1 - tokens / L)``, ``reduction_factor = L / tokens`` and ``knob``, the
    selector config fields (its budget knob) that carry it."""

    tokens: int
    sparsity: float
    reduction_factor: float
    knob: dict[str, Any]


def lower_budget(selector: type, params: dict[str, Any], length: int, *, tokens: int | None = None,
                 sparsity: float | None = None, reduction_factor: float | None = None) -> LoweredBudget:
    """The budget of exactly one of ``tokens``, ``sparsity`` (``1 - density``) or
    ``reduction_factor`` (``L / budget``) at context length ``length``, for ``selector`` (a
    :class:`~kvsieve.sparse.SparseSelector` subclass) configured with ``params`` (its other config
    fields; a unit size not given there is the config's default). Rounding: module docstring.
    Raises :class:`~kvsieve.sparse.knobs.KnobError` naming the selector and its knob when the
    budget cannot be honoured, ``ValueError`` for a selector without a budget knob."""
    given = [name for name, v in (("tokens", tokens), ("sparsity", sparsity), ("reduction_factor", reduction_factor))
             if v is not None]
    if len(given) != 1:
        raise ValueError(f"lower_budget: give exactly one of tokens, sparsity, reduction_factor; got {given}")
    knob: BudgetKnob | None = selector.budget
    if knob is None:
        raise ValueError(f"selector {selector.name!r} declares no budget knob (SparseSelector.budget is None), so a "
                         "budget in tokens or a density cannot be given to it; set its config fields instead")
    where = f"{selector.name}.{knob.field}"
    size = _unit_size(selector, knob, params)
    if tokens is not None:
        if tokens < 1 or tokens % size:
            raise KnobError(f"{where}: a budget of {tokens} tokens is not a whole number (>= 1) of units of {size} "
                            f"tokens ({knob.describe()}); give a multiple of {size}")
        asked = tokens
    else:
        asked = math.ceil(length * (1 - sparsity)) if sparsity is not None else math.ceil(length / reduction_factor)
        if asked // size < 1:
            form = f"sparsity {sparsity:g}" if sparsity is not None else f"reduction factor {reduction_factor:g}"
            raise KnobError(f"{where}: {form} at {length} tokens asks {asked} tokens, less than one unit of {size} "
                            f"tokens ({knob.describe()})")
        asked = asked // size * size
    kept = max(0.0, 1 - asked / length)
    value = {"tokens": asked, "pages": asked // size, "blocks": asked // size, "sparsity": kept}[knob.unit]
    return LoweredBudget(asked, kept, length / asked, {knob.field: value})


def _unit_size(selector: type, knob: BudgetKnob, params: dict[str, Any]) -> int:
    """Tokens per unit of ``knob``: ``params[unit_size_field]``, else the config's default (1 without one)."""
    if knob.unit_size_field is None:
        return 1
    if knob.unit_size_field in params:
        size = params[knob.unit_size_field]
    else:
        default = {f.name: f.default for f in dataclasses.fields(selector.config_class)}[knob.unit_size_field]
        if default is dataclasses.MISSING:
            raise KnobError(f"{selector.name}.{knob.unit_size_field} has no default; give it to size the budget's "
                            f"units ({knob.describe()})")
        size = default
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise KnobError(f"{selector.name}.{knob.unit_size_field} must be an int >= 1 (tokens per unit of the budget), "
                        f"got {size!r}")
    return size
