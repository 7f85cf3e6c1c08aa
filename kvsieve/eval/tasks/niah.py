"""RULER-style needle in a haystack on the Paul Graham essays: word keys, 7-digit values, RULER's
template and answer prefix. ``niah_single``: one needle; ``niah_multikey``: one needle among
distractor needles with other keys (RULER niah_multikey_1). Scored by RULER's string_match_all."""
from __future__ import annotations

import random
from typing import Any

from ..haystack import essay_haystack, insert_at_depths
from ._prompt import haystack_budget
from .base import Sample, Task, random_key, random_number, register_task

__all__ = ["NiahSingleTask", "NiahMultiKeyTask", "ruler_niah_prompt"]

_TEMPLATE = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
             "I will quiz you about the numbers afterwards.\n{context}\n"
             "What are all the special magic numbers for {query} mentioned in the provided text?"
             " The special magic numbers for {query} mentioned in the provided text are")


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def ruler_niah_prompt(context: str, query: str) -> str:
    """RULER's NIAH question around ``context``, ending with the answer prefix."""
    return _TEMPLATE.format(context=context, query=query)


class _Niah(Task):
    max_new_tokens = 16  # room for list-style answers (":\n1. 1234567")
    stop_regex = r"\d{7}\D"
    metric = "RULER string_match_all"
    binary_score = True  # one gold value per sample
    num_distractors = 0

    def make_one(self, tokenizer: Any, length: int, depth: float | None, rng: random.Random, index: int) -> Sample:
        used: set[str] = set()
        key, value = random_key(rng, used), random_number(rng, 7)
        needles = [_needle(key, value)]
        depths = [depth]
        for _ in range(self.num_distractors):
            needles.append(_needle(random_key(rng, used), random_number(rng, 7)))
            depths.append(rng.uniform(0, 100))
        fixed = ruler_niah_prompt("", key)
        hay = essay_haystack(tokenizer, haystack_budget(tokenizer, length, fixed, *needles), start=index + length)
        context, offsets = insert_at_depths(hay, needles, depths)
        head = _TEMPLATE.index("{context}")
        return Sample(index, ruler_niah_prompt(context, key), [value], depth,
                      {"key": key, "needle_char": offsets[0] + head, "context_start": head,
                       "context_chars": len(context)})


@register_task
class NiahSingleTask(_Niah):
    """RULER niah_single_2: one 7-digit magic number for a word key hidden in Paul Graham essays."""

    name = "niah_single"


@register_task
class NiahMultiKeyTask(_Niah):
    """RULER niah_multikey_1: the needle among 3 distractor needles with other keys, in essays."""

    name = "niah_multikey"
    num_distractors = 3
