"""Merge partial attention states (split-K second pass)."""
from __future__ import annotations

from .kernel import merge_states

__all__ = ["merge_states"]
