"""Passkey retrieval in a noise haystack (Landmark-attention / Yarn / Quest style): a 5-digit key
hidden at a depth in repeated filler sentences; exact match of the key."""
from __future__ import annotations

import random
from typing import Any

from ..haystack import insert_at_depths, noise_haystack
from ._prompt import haystack_budget
from .base import Sample, Task, random_number, register_task

__all__ = ["PasskeyTask"]

_HEAD = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n")
_TAIL = "\nWhat is the pass key? The pass key is"


@register_task
class PasskeyTask(Task):
    """A 5-digit pass key hidden at a depth in a noise haystack; 1 if the key is in the answer."""

    name = "passkey"
    metric = "pass key found (exact match)"
    binary_score = True
    max_new_tokens = 8
    stop_regex = r"\d{5}\D"

    def make_one(self, tokenizer: Any, length: int, depth: float | None, rng: random.Random, index: int) -> Sample:
        key = random_number(rng, 5)
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        hay = noise_haystack(tokenizer, haystack_budget(tokenizer, length, _HEAD, _TAIL, needle))
        context, offsets = insert_at_depths(hay, [needle], [depth])
        return Sample(index, _HEAD + context + _TAIL, [key], depth,
                      {"needle_char": offsets[0] + len(_HEAD), "context_start": len(_HEAD),
                       "context_chars": len(context)})
