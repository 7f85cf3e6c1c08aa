"""The ``torch`` backend: the CPU fast path (:class:`TorchBackend`, :mod:`.backend`) and its parts:
which positions a query reads (:mod:`.selection`), the gathers (:mod:`.gather`), the shared-gather
prefill (:mod:`.prefill`), the one-token decode path (:mod:`.token`) and the reused gather buffers
(:mod:`.scratch`)."""
from __future__ import annotations

from .backend import TorchBackend

__all__ = ["TorchBackend"]
