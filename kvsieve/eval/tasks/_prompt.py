"""Shared helpers: how many haystack tokens fit once the template and needles are counted, and the
longest prompt of a countable haystack (words, needles) that fits a length."""
from __future__ import annotations

from typing import Any, Callable

__all__ = ["haystack_budget", "fill_to_length", "prompt_tokens"]


def prompt_tokens(tokenizer: Any, text: str) -> int:
    """Tokens of ``text`` plus 2 for the special tokens the eval's encoding may add."""
    return len(tokenizer.encode(text, add_special_tokens=False)) + 2


def haystack_budget(tokenizer: Any, length: int, *fixed_texts: str) -> int:
    """Tokens left for the haystack in a prompt of ``length`` tokens holding ``fixed_texts``."""
    used = sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in fixed_texts) + len(fixed_texts) + 2
    if used >= length:
        raise ValueError(f"length={length} tokens cannot hold the template and needles ({used} tokens)")
    return length - used


def fill_to_length(tokenizer: Any, length: int, build: Callable[[int], str], most: int, what: str) -> int:
    """The largest ``n`` in ``[0, most]`` whose prompt ``build(n)`` fits ``length`` tokens
    (:func:`prompt_tokens`); ``build`` must grow with ``n``. A ``ValueError`` names ``what`` when
    even ``build(0)`` does not fit, or when ``build(most)`` still fits: the haystack ran out of
    units before the prompt reached ``length`` tokens."""
    empty = prompt_tokens(tokenizer, build(0))
    if empty > length:
        raise ValueError(f"{what}: length={length} tokens cannot hold the template ({empty} tokens)")
    full = prompt_tokens(tokenizer, build(most))
    if full <= length:
        raise ValueError(f"{what}: its haystack cannot fill length={length} tokens: all {most} units make "
                         f"{full} tokens")
    lo, hi = 0, most  # build(lo) fits, build(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if prompt_tokens(tokenizer, build(mid)) <= length:
            lo = mid
        else:
            hi = mid
    return lo
