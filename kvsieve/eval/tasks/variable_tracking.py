"""RULER-style variable tracking: a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... scattered in a
noise haystack; the model must list every variable holding the value. The first assignment sits
at the depth; the hops follow at evenly spaced points after it. Scored by string_match_all."""
from __future__ import annotations

import random
import string
from typing import Any

from ..haystack import insert_at_depths, noise_haystack
from ._prompt import haystack_budget
from .base import Sample, Task, random_number, register_task

__all__ = ["VariableTrackingTask"]

_HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
_QUESTION = ("\nQuestion: Find all variables that are assigned the value {value} in the text above."
             " Answer: According to the chain(s) of variable assignment in the text above, {n} variables are "
             "assigned the value {value}, they are:")


@register_task
class VariableTrackingTask(Task):
    """RULER variable tracking: a chain VAR A = 12345. VAR B = VAR A. ... in noise; name every variable."""

    name = "variable_tracking"
    metric = "share of variables named"
    max_new_tokens = 16
    num_hops = 2

    def make_one(self, tokenizer: Any, length: int, depth: float | None, rng: random.Random, index: int) -> Sample:
        value = random_number(rng, 5)
        names: list[str] = []
        while len(names) < self.num_hops + 1:
            name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
            if name not in names:
                names.append(name)
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        question = _QUESTION.format(value=value, n=len(names))
        hay = noise_haystack(tokenizer, haystack_budget(tokenizer, length, _HEAD, question, *chain))
        step = (100 - depth) / (len(chain) + 1)
        depths = [depth + i * step for i in range(len(chain))]
        context, offsets = insert_at_depths(hay, chain, depths)
        return Sample(index, _HEAD + context + question, names, depth,
                      {"needle_char": offsets[0] + len(_HEAD), "context_start": len(_HEAD),
                       "context_chars": len(context)})
