"""Bridges from model libraries to kvsieve. Each integration imports its library lazily:
``from kvsieve.integrations.transformers import KvsieveSession``. Nothing inside the core
``kvsieve`` areas imports this package."""
from __future__ import annotations

__all__: list[str] = []
