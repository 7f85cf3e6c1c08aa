"""Shared helper: how many haystack tokens fit once the template and needles are counted."""
from __future__ import annotations

from typing import Any

__all__ = ["haystack_budget"]


def haystack_budget(tokenizer: Any, length: int, *fixed_texts: str) -> int:
    """Tokens left for the haystack in a prompt of ``length`` tokens holding ``fixed_texts``."""
    used = sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in fixed_texts) + len(fixed_texts) + 2
    if used >= length:
        raise ValueError(f"length={length} tokens cannot hold the template and needles ({used} tokens)")
    return length - used
