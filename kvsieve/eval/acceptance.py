"""The ``acceptance`` task of ``kvsieve eval``: how many tokens lossless sparse decoding
(``docs/lossless.md``) would keep per dense verify pass, per selector, budget and length, on
essay continuations.

Option ``draft_lengths`` (``tasks.acceptance.params``): the draft lengths ``K`` the row reports,
default ``[2, 4, 8]`` (the columns of ``summary.csv``), any of them with ``4`` (the score's): fewer
lengths cost fewer engines in the served sweep. The prompt (an essay
cut to the sweep's length) runs through lossless decoding's own rounds
(:func:`~kvsieve.integrations.transformers.speculate.speculative_decode`, greedy, the longest ``K``,
say ``8``; it prefills the prompt again, densely): the selector drafts ``8`` greedy tokens (sparse
decode steps), the cache rolls back and one dense pass over the ``9`` positions verifies them; the
round accepts ``j`` drafts and goes on from the verified tokens, until ``max_new_tokens`` tokens are
decoded (the rounds with all ``8`` drafts are counted). Greedy drafts of
one round are nested (the first ``K`` of the ``8`` are the round's drafts at ``K``), so the same round
at ``K`` accepts ``min(j, K)``: the row reports the mean accepted length (tokens per dense pass,
``1 + mean accepted drafts``) at every ``K`` (``accepted_length_k{K}``) over the same rounds (a run
at ``K`` starts its rounds where its own acceptance leaves them: an estimate, not a replay) and the
acceptance by draft position at the longest (``acceptance_by_position_k{K}``). Score: the mean
accepted length at ``K = 4`` (:data:`SCORE_K`).

A config lossless decoding refuses (an evicting selector, ...) fails the run with that refusal.
"""
from __future__ import annotations

from typing import Any

import torch

from ..integrations.transformers.generate_args import GenerateRequest
from ..integrations.transformers.speculate import speculation_refusal, speculative_decode
from ..sparse.speculation import AcceptanceStats
from .tasks.base import Sample, Task, register_task
from .tasks.fidelity import FidelityTask

__all__ = ["AcceptanceTask", "DRAFT_LENGTHS", "SCORE_K"]

#: the draft lengths a row reports by default (the rounds draft the longest)
DRAFT_LENGTHS = (2, 4, 8)
#: the draft length whose mean accepted length is the score
SCORE_K = 4


@register_task
class AcceptanceTask(Task):
    """Mean accepted length of lossless sparse decoding on an essay's greedy continuation."""

    name = "acceptance"
    metric = "mean accepted length at K=4 (tokens per dense verify pass)"
    uses_depths = False
    max_new_tokens = 32
    options = {"draft_lengths": list(DRAFT_LENGTHS)}

    def check_options(self) -> None:
        ks = self.params["draft_lengths"]
        if (not isinstance(ks, (list, tuple)) or any(isinstance(k, bool) or k not in DRAFT_LENGTHS for k in ks)
                or len(set(ks)) != len(ks) or SCORE_K not in ks):
            raise ValueError(f"draft_lengths must be distinct values of {list(DRAFT_LENGTHS)} including {SCORE_K} "
                             f"(the score's K), got {ks!r}")

    @property
    def draft_lengths(self) -> tuple[int, ...]:
        """The draft lengths the row reports, ascending."""
        return tuple(sorted(self.params["draft_lengths"]))

    make_one = FidelityTask.make_one  # the fidelity task's prompts: an essay from a random start

    def run(self, session: Any, logits: torch.Tensor, ids: torch.Tensor, sample: Sample, reference: Any,
            tokenizer: Any) -> dict[str, Any]:
        k = self.draft_lengths[-1]
        plans = [layer.plan for layer in session.layers]
        why = speculation_refusal(k, plans, prefix_caching=session.prefix_caching) if any(plans) else None
        if why is not None:
            raise ValueError(f"acceptance: {why}")
        stats = speculative_decode(session, GenerateRequest(ids, self.max_new_tokens, None, (), None), k).acceptance
        row: dict[str, Any] = {f"accepted_length_k{n}": _capped(stats, n).mean_accepted_length
                               for n in self.draft_lengths}
        row[f"acceptance_by_position_k{k}"] = "|".join(f"{a:.4f}" for a in stats.acceptance_by_position)
        row["score"] = row[f"accepted_length_k{SCORE_K}"]
        return row


def _capped(stats: AcceptanceStats, k: int) -> AcceptanceStats:
    """The same rounds with ``k`` drafts: a round that accepted ``j`` accepts ``min(j, k)``."""
    hist = list(stats.histogram[:k]) + [sum(stats.histogram[k:])]
    return AcceptanceStats(k, tuple(hist))
