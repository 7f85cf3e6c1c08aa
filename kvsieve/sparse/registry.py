"""Registries of named plug-ins: one :class:`Registry` serves selectors and backends alike.

Built-ins register in-process with a class decorator (``@register_selector``,
``@register_backend``); third-party packages declare an entry point, read lazily on the first
lookup of a name not registered in-process::

    [project.entry-points."kvsieve.selectors"]
    my_selector = "my_pkg.module:MySelector"

    [project.entry-points."kvsieve.backends"]
    my_backend = "my_pkg.attn:MyBackend"

The entry-point name is the plug-in's ``name``. Every misuse is an error naming the plug-in: an
entry point whose import raises (:class:`PluginError` naming the entry point and its
distribution), a name registered twice (by two classes, or by an entry point shadowing a
built-in), an object of the wrong type, and whatever the registry's ``check`` rejects (a
selector overriding no hook, or declaring a budget knob its config does not have).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Generic, TypeVar

from .budget import BudgetKnob
from .selector_base import SparseSelector

__all__ = ["PluginError", "Registry", "ENTRY_POINT_GROUP", "register_selector", "get_selector_class",
           "create_selector", "available_selectors", "SELECTORS"]

T = TypeVar("T", bound=type)


class PluginError(ImportError):
    """A plug-in entry point could not be loaded (names the entry point and its distribution)."""


class Registry(Generic[T]):
    """Name -> class for one kind of plug-in (``kind``: ``"selector"``, ``"backend"``).

    ``base``: the class every plug-in subclasses; ``group``: the entry-point group; ``builtin``:
    name -> ``"module:attr"`` of built-ins imported only when first asked for (their module
    registers them); ``check(cls)``: extra rules, raising ``TypeError``/``ValueError``.
    """

    def __init__(self, kind: str, base: type, group: str, *, builtin: dict[str, str] | None = None,
                 check: Callable[[type], None] | None = None) -> None:
        self.kind, self.base, self.group = kind, base, group
        self.builtin = dict(builtin or {})
        self.check = check
        self._classes: dict[str, T] = {}

    def register(self, cls: T) -> T:
        """Class decorator: register ``cls`` under ``cls.name`` (the same class twice is a no-op)."""
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(f"register_{self.kind} expects a {self.base.__name__} subclass, got {cls!r}")
        name = getattr(cls, "name", "")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{cls.__qualname__} has no `name` (a non-empty str)")
        old = self._classes.get(name)
        if old is not None and old is not cls:
            raise ValueError(f"{self.kind} name {name!r} is already registered by "
                             f"{old.__module__}.{old.__qualname__}; {cls.__module__}.{cls.__qualname__} "
                             f"cannot take it")
        if self.check is not None:
            self.check(cls)
        self._classes[name] = cls
        return cls

    def entry_points(self) -> dict[str, EntryPoint]:
        return {ep.name: ep for ep in entry_points(group=self.group)}

    def available(self) -> list[str]:
        """Names of built-in, registered and entry-point plug-ins."""
        return sorted(set(self._classes) | set(self.builtin) | set(self.entry_points()))

    def get(self, name: str) -> T:
        """The class registered as ``name``; unknown names list the known ones."""
        eps = self.entry_points()
        taken = name in self._classes or name in self.builtin
        if name in eps and taken and not self._same(self._classes.get(name), eps[name]):
            raise ValueError(f"entry point {name!r} in group {self.group!r} ({eps[name].value}, distribution "
                             f"{_dist(eps[name])}) uses the name of the built-in {self.kind} {name!r}; "
                             f"rename the entry point")
        if name not in self._classes and name in self.builtin:
            module, _ = self.builtin[name].split(":")
            importlib.import_module(module)
        if name in self._classes:
            return self._classes[name]
        if name not in eps:
            raise ValueError(f"unknown {self.kind} {name!r}; known {self.kind}s: {self.available()}")
        return self._load(name, eps[name])

    def _load(self, name: str, ep: EntryPoint) -> T:
        where = f"entry point {name!r} in group {self.group!r} ({ep.value}, distribution {_dist(ep)})"
        try:
            cls = ep.load()
        except Exception as err:  # noqa: BLE001  (re-raised with the entry point named)
            raise PluginError(f"{where} failed to import: {type(err).__name__}: {err}") from err
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(f"{where} is not a {self.base.__name__} subclass: {cls!r}")
        if getattr(cls, "name", None) != name:
            raise ValueError(f"{where} loads {cls.__qualname__} whose name is {getattr(cls, 'name', None)!r}")
        try:
            return self.register(cls)
        except (TypeError, ValueError) as err:
            raise type(err)(f"{where}: {err}") from None

    @staticmethod
    def _same(cls: type | None, ep: EntryPoint) -> bool:
        return cls is not None and ep.value == f"{cls.__module__}:{cls.__qualname__}"


def _dist(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else "unknown"


def _check_selector(cls: type) -> None:
    if cls.budget is not None:
        if not isinstance(cls.budget, BudgetKnob):
            raise TypeError(f"selector {cls.name!r} ({cls.__qualname__}): budget must be a BudgetKnob or None, "
                            f"got {cls.budget!r}")
        cls.budget.check_fields(cls.config_class, cls.name)
    if (cls.predict_kv is SparseSelector.predict_kv and cls.predict_attn is SparseSelector.predict_attn):
        raise TypeError(f"selector {cls.name!r} ({cls.__qualname__}) overrides neither predict_kv nor "
                        f"predict_attn; it would run dense")


ENTRY_POINT_GROUP = "kvsieve.selectors"
SELECTORS: Registry[type[SparseSelector]] = Registry("selector", SparseSelector, ENTRY_POINT_GROUP,
                                                     check=_check_selector)
S = TypeVar("S", bound=type[SparseSelector])


def register_selector(cls: S) -> S:
    """Class decorator: register a selector under ``cls.name``."""
    return SELECTORS.register(cls)


def available_selectors() -> list[str]:
    """Names of built-in and entry-point selectors."""
    return SELECTORS.available()


def get_selector_class(name: str) -> type[SparseSelector]:
    return SELECTORS.get(name)


def create_selector(name: str, **config: Any) -> SparseSelector:
    """Instantiate the selector ``name`` with config fields ``config`` (validated by its dataclass)."""
    cls = get_selector_class(name)
    try:
        return cls(**config)
    except TypeError as err:
        fields = list(getattr(cls.config_class, "__dataclass_fields__", {}))
        raise ValueError(f"selector {name!r}: bad config {sorted(config)} ({err}); accepted fields: {fields}") from None
