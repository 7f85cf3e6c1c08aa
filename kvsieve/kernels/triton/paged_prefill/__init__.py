"""Paged prefill / chunked prefill (dense query tiles or per-token sparse gather)."""
from __future__ import annotations

from .kernel import paged_prefill
from .plan import select_prefill_path

__all__ = ["paged_prefill", "select_prefill_path"]
