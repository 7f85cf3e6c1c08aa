"""Backend selection: a name -> backend table, loaded lazily (a backend's kernels import only
when it is chosen); each backend is a narrow object (see ``base``)."""
from __future__ import annotations

import importlib

import torch

from .base import AttentionBackend, AttentionGeometry
from .torch_backend import TorchBackend
from .vanilla import VanillaBackend, masked_attention

__all__ = ["AttentionBackend", "AttentionGeometry", "VanillaBackend", "TorchBackend", "masked_attention",
           "get_backend", "available_backends", "default_backend"]

# name -> "module:Class" relative to this package
_BACKENDS = {
    "vanilla": "vanilla:VanillaBackend",
    "torch": "torch_backend:TorchBackend",
    "triton": "triton_backend:TritonBackend",
    "cute": "cute:CuteBackend",
}
# the fast path per device type; "vanilla" is the golden, never a default
_DEFAULTS = {"cpu": "torch", "cuda": "triton"}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str) -> AttentionBackend:
    """A fresh backend instance by name; unknown names list the known ones."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known backends: {available_backends()}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)()


def default_backend(device: str | torch.device) -> str:
    """Name of the default backend for a device: ``torch`` on CPU, ``triton`` on CUDA."""
    kind = torch.device(device).type
    if kind not in _DEFAULTS:
        raise ValueError(f"no default backend for device type {kind!r}; known: {sorted(_DEFAULTS)}")
    return _DEFAULTS[kind]
