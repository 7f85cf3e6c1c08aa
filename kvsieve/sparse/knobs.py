"""One check for every configuration knob: its type (from the dataclass's type hints) and its
declared range (from :func:`knob`), with an error naming the knob and what it accepts.

A config dataclass declares each knob's range where it defines the field and calls
:func:`check_knobs` first thing in ``__post_init__``::

    @dataclass(frozen=True)
    class MyConfig:
        budget: int = knob(256, ge=1)
        summary_dtype: str = knob("bfloat16", choices=("bfloat16", "float32"))

        def __post_init__(self) -> None:
            check_knobs(self, "mine")

Types: ``int`` takes ints only (``bool`` is not an int, ``37.5`` and ``nan`` are not either);
``float`` takes finite ints and floats (``nan``/``inf`` are refused, ``bool`` too); ``bool`` only
``True``/``False``; ``str`` only strings; ``tuple[X, ...]`` a tuple (a ``str`` is not a tuple of
characters); ``X | None`` also ``None``; ``dict[K, V]`` a dict of such keys and values.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Iterable
from typing import Any

__all__ = ["KnobError", "knob", "check_knobs", "check_value"]


class KnobError(ValueError):
    """A configuration knob has the wrong type or is out of its range; the message names both."""


def knob(default: Any = dataclasses.MISSING, *, ge: float | None = None, gt: float | None = None,
         le: float | None = None, lt: float | None = None, choices: Iterable[Any] | None = None,
         doc: str | None = None, default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with a declared range (bounds are inclusive ``ge``/``le`` or strict
    ``gt``/``lt``, or a set of ``choices``); ``doc`` (a few words) is repeated in errors."""
    meta = {"knob": {"ge": ge, "gt": gt, "le": le, "lt": lt, "doc": doc,
                     "choices": None if choices is None else tuple(choices)}}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def check_knobs(config: Any, owner: str) -> None:
    """Check every field of the dataclass instance ``config`` against its type hint and range;
    raise :class:`KnobError` ``"<owner>.<knob> must be ..., got ..."`` on the first bad one."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        spec = dict(f.metadata.get("knob", {}))
        doc = spec.pop("doc", None)
        name = f"{owner}.{f.name}" + (f" ({doc})" if doc else "")
        check_value(name, getattr(config, f.name), hints.get(f.name, Any), **spec)


def check_value(name: str, value: Any, hint: Any, *, ge: float | None = None, gt: float | None = None,
                le: float | None = None, lt: float | None = None, choices: tuple | None = None) -> None:
    """Check one value against a type hint and a range; raise :class:`KnobError` naming ``name``:
    ``"<name> must be <type> <range>, got <type> <value>"`` for a wrong type, ``"<name> must be
    <range> (<type>), got <value>"`` for a value out of range."""
    optional = type(None) in typing.get_args(hint)
    kind = _type_name(hint) + (" or None" if optional else "")
    span = f"one of {list(choices)}" if choices is not None else _range(ge, gt, le, lt)
    if not _has_type(value, hint):
        wanted = _type_name(hint) + (f" {span}" if span else "") + (" (or None)" if optional else "")
        raise KnobError(f"{name} must be {wanted}, got {type(value).__name__} {value!r}")
    if value is None:
        return
    inside = (choices is None or value in choices) and all(
        bound is None or ok(bound) for bound, ok in ((ge, lambda b: value >= b), (gt, lambda b: value > b),
                                                     (le, lambda b: value <= b), (lt, lambda b: value < b)))
    if not inside:
        raise KnobError(f"{name} must be {span} ({kind}), got {value!r}")


def _range(ge: Any, gt: Any, le: Any, lt: Any) -> str:
    lo = ("[", ge) if ge is not None else ("(", gt) if gt is not None else None
    hi = (le, "]") if le is not None else (lt, ")") if lt is not None else None
    if lo and hi:
        return f"in {lo[0]}{lo[1]}, {hi[0]}{hi[1]}"
    if lo:
        return f"{'>=' if lo[0] == '[' else '>'} {lo[1]}"
    if hi:
        return f"{'<=' if hi[1] == ']' else '<'} {hi[0]}"
    return ""


def _has_type(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if origin is typing.Literal:
        return value in args
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_has_type(v, args[0]) for v in value)
        return len(args) == len(value) and all(_has_type(v, a) for v, a in zip(value, args))
    if origin is dict:
        return isinstance(value, dict) and all(_has_type(k, args[0]) and _has_type(v, args[1])
                                               for k, v in value.items())
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args if a is not type(None))
    if hint is Any:
        return "any value"
    names = {int: "an int", float: "a finite float", bool: "a bool", str: "a string"}
    if hint in names:
        return names[hint]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"a tuple of {_type_name(args[0]).removeprefix('an ').removeprefix('a ')}s"
    if origin is dict:
        return f"a dict of {_type_name(args[0]).removeprefix('a ')} -> {_type_name(args[1])}"
    if origin is typing.Literal:
        return f"one of {list(args)}"
    return getattr(hint, "__name__", str(hint))
