"""Backend selection: a name -> backend table; each backend is a narrow object (see ``base``)."""
from __future__ import annotations

from .base import AttentionBackend, AttentionGeometry
from .vanilla import VanillaBackend, masked_attention

__all__ = ["AttentionBackend", "AttentionGeometry", "VanillaBackend", "masked_attention", "get_backend",
           "available_backends"]

_BACKENDS: dict[str, type[AttentionBackend]] = {VanillaBackend.name: VanillaBackend}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str) -> AttentionBackend:
    """A fresh backend instance by name; unknown names list the known ones."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known backends: {available_backends()}")
    return _BACKENDS[name]()
