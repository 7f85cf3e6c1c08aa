"""Backend selection: a name -> backend table; each backend is a narrow object (see ``base``)."""
from __future__ import annotations

import torch

from .base import AttentionBackend, AttentionGeometry
from .torch_backend import TorchBackend
from .vanilla import VanillaBackend, masked_attention

__all__ = ["AttentionBackend", "AttentionGeometry", "VanillaBackend", "TorchBackend", "masked_attention", "get_backend",
           "available_backends", "default_backend"]

_BACKENDS: dict[str, type[AttentionBackend]] = {VanillaBackend.name: VanillaBackend, TorchBackend.name: TorchBackend}
# the fast path per device type; "vanilla" is the golden, never a default
_DEFAULTS = {"cpu": "torch", "cuda": "triton"}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str) -> AttentionBackend:
    """A fresh backend instance by name; unknown names list the known ones."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known backends: {available_backends()}")
    return _BACKENDS[name]()


def default_backend(device: str | torch.device) -> str:
    """Name of the default backend for a device: ``torch`` on CPU, ``triton`` on CUDA."""
    kind = torch.device(device).type
    if kind not in _DEFAULTS:
        raise ValueError(f"no default backend for device type {kind!r}; known: {sorted(_DEFAULTS)}")
    return _DEFAULTS[kind]
