"""Selector registry: a decorator for built-ins, the ``kvsieve.selectors`` entry-point group for
third-party packages, and :func:`create_selector` that finds both.

A third-party package declares, in its ``pyproject.toml``::

    [project.entry-points."kvsieve.selectors"]
    my_selector = "my_pkg.module:MySelector"

The entry-point name is the selector name; the object must be a :class:`SparseSelector`
subclass. Entry points are read lazily, on the first lookup of a name not registered in-process.
"""
from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any, TypeVar

from .algorithm import SparseSelector

__all__ = ["ENTRY_POINT_GROUP", "register_selector", "get_selector_class", "create_selector", "available_selectors"]

ENTRY_POINT_GROUP = "kvsieve.selectors"
_REGISTRY: dict[str, type[SparseSelector]] = {}
S = TypeVar("S", bound=type[SparseSelector])


def register_selector(cls: S) -> S:
    """Class decorator: register a built-in selector under ``cls.name``."""
    if not (isinstance(cls, type) and issubclass(cls, SparseSelector)):
        raise TypeError(f"register_selector expects a SparseSelector subclass, got {cls!r}")
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no `name`")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"selector name {cls.name!r} is already registered by {_REGISTRY[cls.name].__qualname__}")
    _REGISTRY[cls.name] = cls
    return cls


def _entry_points() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_selectors() -> list[str]:
    """Names of built-in and entry-point selectors."""
    return sorted(set(_REGISTRY) | set(_entry_points()))


def get_selector_class(name: str) -> type[SparseSelector]:
    if name in _REGISTRY:
        return _REGISTRY[name]
    eps = _entry_points()
    if name not in eps:
        raise ValueError(f"unknown selector {name!r}; known selectors: {available_selectors()}")
    cls = eps[name].load()
    if not (isinstance(cls, type) and issubclass(cls, SparseSelector)):
        raise TypeError(
            f"entry point {name!r} in group {ENTRY_POINT_GROUP!r} ({eps[name].value}) is not a SparseSelector subclass"
        )
    if cls.name != name:
        raise ValueError(f"entry point {name!r} loads {cls.__qualname__} whose name is {cls.name!r}")
    _REGISTRY[name] = cls
    return cls


def create_selector(name: str, **config: Any) -> SparseSelector:
    """Instantiate the selector ``name`` with config fields ``config`` (validated by its dataclass)."""
    cls = get_selector_class(name)
    try:
        return cls(**config)
    except TypeError as err:
        fields = list(getattr(cls.config_class, "__dataclass_fields__", {}))
        raise ValueError(f"selector {name!r}: bad config {sorted(config)} ({err}); accepted fields: {fields}") from None
