"""The ``acceptance`` task of ``kvsieve eval``: how many tokens lossless sparse decoding
(``docs/lossless.md``) would keep per dense verify pass, per selector, budget and length, on
essay continuations.

The prompt (an essay cut to the sweep's length) runs through lossless decoding's own rounds
(:func:`~kvsieve.integrations.transformers.speculate.speculative_decode`, greedy, ``K = 8``; it
prefills the prompt again, densely): the selector drafts ``8`` greedy tokens (sparse decode
steps), the cache rolls back and one dense pass over the ``9`` positions verifies them; the round
accepts ``j`` drafts and goes on from the verified tokens, until ``max_new_tokens`` tokens are
decoded (the rounds with all ``8`` drafts are counted). Greedy drafts of
one round are nested (the first ``K`` of the ``8`` are the round's drafts at ``K``), so the same round
at ``K`` accepts ``min(j, K)``: the row reports the mean accepted length (tokens per dense pass,
``1 + mean accepted drafts``) at ``K = 2, 4, 8`` over the same rounds (a run at ``K`` starts its
rounds where its own acceptance leaves them: an estimate, not a replay) and the acceptance by draft
position at ``K = 8``. Score: the mean accepted length at ``K = 4``.

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

__all__ = ["AcceptanceTask", "DRAFT_LENGTHS"]

#: the draft lengths the row reports (the rounds draft the longest)
DRAFT_LENGTHS = (2, 4, 8)


@register_task
class AcceptanceTask(Task):
    """Mean accepted length of lossless sparse decoding on an essay's greedy continuation."""

    name = "acceptance"
    metric = "mean accepted length at K=4 (tokens per dense verify pass)"
    uses_depths = False
    max_new_tokens = 32

    make_one = FidelityTask.make_one  # the fidelity task's prompts: an essay from a random start

    def run(self, session: Any, logits: torch.Tensor, ids: torch.Tensor, sample: Sample, reference: Any,
            tokenizer: Any) -> dict[str, Any]:
        k = max(DRAFT_LENGTHS)
        plans = [layer.plan for layer in session.layers]
        why = speculation_refusal(k, plans, prefix_caching=session.prefix_caching) if any(plans) else None
        if why is not None:
            raise ValueError(f"acceptance: {why}")
        stats = speculative_decode(session, GenerateRequest(ids, self.max_new_tokens, None, (), None), k).acceptance
        row: dict[str, Any] = {f"accepted_length_k{n}": _capped(stats, n).mean_accepted_length for n in DRAFT_LENGTHS}
        row["acceptance_by_position_k8"] = "|".join(f"{a:.4f}" for a in stats.acceptance_by_position)
        row["score"] = row["accepted_length_k4"]
        return row


def _capped(stats: AcceptanceStats, k: int) -> AcceptanceStats:
    """The same rounds with ``k`` drafts: a round that accepted ``j`` accepts ``min(j, k)``."""
    hist = list(stats.histogram[:k]) + [sum(stats.histogram[k:])]
    return AcceptanceStats(k, tuple(hist))
