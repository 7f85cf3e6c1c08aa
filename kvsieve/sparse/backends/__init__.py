"""Backends by name: the built-ins (``vanilla`` golden, ``torch``, ``triton``, ``cute``, ``sdpa``)
load lazily through the shared registry (a backend's kernels import only when it is chosen);
other packages add backends with ``@register_backend`` or the ``kvsieve.backends`` entry point."""
from __future__ import annotations

from typing import Any

import torch

from .base import (BACKEND_ENTRY_POINT_GROUP, BACKENDS, AttentionBackend, AttentionGeometry, AttentionResult,
                   BackendCapabilities, register_backend)
from .torch_backend import TorchBackend
from .vanilla import VanillaBackend, masked_attention

__all__ = ["AttentionBackend", "AttentionGeometry", "AttentionResult", "BackendCapabilities", "VanillaBackend",
           "TorchBackend", "masked_attention", "get_backend", "available_backends", "default_backend",
           "register_backend", "BACKEND_ENTRY_POINT_GROUP"]

# built-ins import lazily: a backend's kernels load only when it is chosen
BACKENDS.builtin.update({
    "vanilla": "kvsieve.sparse.backends.vanilla:VanillaBackend",
    "torch": "kvsieve.sparse.backends.torch_backend:TorchBackend",
    "triton": "kvsieve.sparse.backends.triton_backend:TritonBackend",
    "cute": "kvsieve.sparse.backends.cute:CuteBackend",
    "sdpa": "kvsieve.sparse.backends.sdpa:SdpaBackend",
})

# the fast path per device type; "vanilla" is the golden, never a default
_DEFAULTS = {"cpu": "torch", "cuda": "triton"}


def available_backends() -> list[str]:
    return BACKENDS.available()


def get_backend(name: str, **options: Any) -> AttentionBackend:
    """A fresh backend instance by name (``options`` go to its constructor); unknown names list
    the known ones."""
    return BACKENDS.get(name)(**options)


def default_backend(device: str | torch.device) -> str:
    """Name of the default backend for a device: ``torch`` on CPU, ``triton`` on CUDA."""
    kind = torch.device(device).type
    if kind not in _DEFAULTS:
        raise ValueError(f"no default backend for device type {kind!r}; known: {sorted(_DEFAULTS)}")
    return _DEFAULTS[kind]
