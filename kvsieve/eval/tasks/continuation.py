"""Greedy continuation of an essay at the end of a long context, scored against the dense run.

The prompt is ``length`` tokens of Paul Graham essays (starting at a random essay, cut at a sentence
end); every run decodes :attr:`ContinuationTask.max_new_tokens` tokens greedily, never stopping at
EOS. The score is the number of tokens equal to the dense run's continuation of the same prompt
before the first difference, over ``max_new_tokens`` (``matched_tokens`` in ``predictions.csv``
gives the count): the quantity that predicts how many tokens of a sparse draft a dense verifier
would accept. The dense run is the reference (it scores 1), so the runner runs it first on every
sample (:attr:`~.base.Task.needs_reference`).
"""
from __future__ import annotations

import random
from typing import Any

from ..haystack import check_essay_length, essay_files, essay_haystack
from .base import Sample, Task, register_task

__all__ = ["ContinuationTask", "matched_prefix"]


def matched_prefix(tokens: list[int], reference: list[int]) -> int:
    """How many of ``tokens`` equal ``reference``'s before the first difference."""
    n = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        n += 1
    return n


@register_task
class ContinuationTask(Task):
    """Greedy continuation of a long essay context, scored by the tokens equal to dense's before the first difference."""

    name = "essay_continuation"
    metric = "tokens equal to dense's before the first difference (share of 32)"
    uses_depths = False
    needs_reference = True
    max_new_tokens = 32

    def check_length(self, length: int) -> None:
        check_essay_length(length)

    def make_one(self, tokenizer: Any, length: int, depth: float | None, rng: random.Random, index: int) -> Sample:
        text = essay_haystack(tokenizer, length - 2, start=rng.randrange(len(essay_files())))  # room for <bos>
        return Sample(index, text, [], None, {})

    def run(self, session: Any, logits: Any, ids: Any, sample: Sample, reference: list[int] | None,
            tokenizer: Any) -> dict[str, Any]:
        """Decode ``max_new_tokens`` tokens; ``reference``: the dense run's (``None`` for the dense run)."""
        new = session.continue_greedy(logits, self.max_new_tokens)
        return self.reference_row(new[0].tolist(), reference, tokenizer)

    def reference_row(self, tokens: list[int], reference: list[int] | None, tokenizer: Any) -> dict[str, Any]:
        """The row of a continuation ``tokens`` against ``reference`` (``None``: it is the reference);
        ``_reference`` carries the tokens to the runs after the dense one."""
        if len(tokens) != self.max_new_tokens or (reference is not None and len(reference) != self.max_new_tokens):
            raise ValueError(f"{self.name}: expected {self.max_new_tokens} tokens, got {len(tokens)}"
                             + ("" if reference is None else f" against a reference of {len(reference)}"))
        matched = matched_prefix(tokens, tokens if reference is None else reference)
        return {"prediction": tokenizer.decode(tokens, skip_special_tokens=True), "score": matched / len(tokens),
                "matched_tokens": matched, "_reference": tokens}
