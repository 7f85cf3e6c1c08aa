"""RULER's variable tracking (``vt`` in RULER's ``synthetic.yaml``: one chain, 4 hops, noise
haystack): ``VAR ABCDE = 12345``, ``VAR FGHIJ = VAR ABCDE``, ... each on its own line among RULER's
noise lines, after one worked example (RULER's one-shot example: a prompt of about 500 tokens with
3-letter variables, followed by its answer). The model must list every variable holding the value;
scored by RULER's string_match_all (the share of the 5 variables named).

One kvsieve addition: the first assignment sits at the sample's depth (RULER draws every position
at random); the hops follow at uniform random lines after it, in chain order.
"""
from __future__ import annotations

import random
import string
from typing import Any

from ..haystack import NOISE
from ._prompt import fill_to_length
from .base import Sample, Task, random_number, register_task

__all__ = ["VariableTrackingTask"]

_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
             "Question: Find all variables that are assigned the value {value} in the text above."
             " Answer: According to the chain(s) of variable assignment in the text above, {n} variables are "
             "assigned the value {value}, they are: ")
_EXAMPLE_TOKENS = 500  # RULER's one-shot example is a prompt of this length
_EXAMPLE_LETTERS, _LETTERS = 3, 5


class _Chain:
    """One chain of ``hops`` assignments, with variables of ``letters`` letters, placed among noise
    lines: the first at ``depth`` percent of the lines, the rest at random lines after it."""

    def __init__(self, rng: random.Random, hops: int, letters: int, depth: float) -> None:
        self.names: list[str] = []
        while len(self.names) < hops + 1:
            name = "".join(rng.choice(string.ascii_uppercase) for _ in range(letters))
            if name not in self.names:
                self.names.append(name)
        self.value = random_number(rng, 5)
        self.lines = [f"VAR {self.names[0]} = {self.value}"] + [
            f"VAR {b} = VAR {a} " for a, b in zip(self.names, self.names[1:])]
        self.depths = [depth] + sorted(rng.uniform(depth, 100) for _ in range(hops))

    def context(self, num_noise: int) -> str:
        """``num_noise`` noise lines with the chain's lines inserted, one per line."""
        lines = [NOISE] * num_noise
        for j, (line, depth) in enumerate(zip(self.lines, self.depths)):
            lines.insert(int(num_noise * depth / 100) + j, line)
        return "\n".join(lines)

    def prompt(self, num_noise: int) -> str:
        return _TEMPLATE.format(context=self.context(num_noise), value=self.value, n=len(self.names))


def _filled(tokenizer: Any, length: int, chain: _Chain, prefix: str, what: str) -> str:
    """``prefix`` and the chain's prompt with as many noise lines as fit ``length`` tokens (a noise
    line has 19 words, so ``length // 8`` lines overfill any tokenizer)."""
    n = fill_to_length(tokenizer, length, lambda k: prefix + chain.prompt(k), max(1, length // 8), what)
    return prefix + chain.prompt(n)


@register_task
class VariableTrackingTask(Task):
    """RULER vt: one chain of 4 hops (VAR ABCDE = 12345, VAR FGHIJ = VAR ABCDE, ...) in noise lines, one worked example."""

    name = "variable_tracking"
    metric = "RULER string_match_all (share of variables named)"
    max_new_tokens = 30  # RULER's tokens_to_generate
    num_hops = 4
    revision = 1  # 0: 2 hops, each assignment a sentence among noise sentences, no worked example

    def make_one(self, tokenizer: Any, length: int, depth: float | None, rng: random.Random, index: int) -> Sample:
        where = f"task {self.name}"
        example = _Chain(rng, self.num_hops, _EXAMPLE_LETTERS, rng.uniform(0, 100))
        shot = _filled(tokenizer, _EXAMPLE_TOKENS, example, "", f"{where} (its worked example)")
        prefix = f"{shot} {' '.join(example.names)}\n\n"
        chain = _Chain(rng, self.num_hops, _LETTERS, depth)
        prompt = _filled(tokenizer, length, chain, prefix, where)
        head = len(prefix) + _TEMPLATE.index("{context}")
        context = prompt[head: prompt.rindex("\nQuestion: ")]
        return Sample(index, prompt, chain.names, depth,
                      {"needle_char": head + context.index(chain.lines[0]), "context_start": head,
                       "context_chars": len(context)})
