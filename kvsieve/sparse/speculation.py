"""Lossless speculative decoding's rule: a sparse pass drafts, a dense pass verifies.

A round starts from ``L`` cached positions and one pending token ``t`` (at position ``L``). The
drafter (the same model, its attention restricted by a selector) runs ``K`` one-token steps: ``t``
then each draft, giving draft tokens ``d_1..d_K`` and, when sampling, the draft distributions
``q_1..q_K``. The verifier runs one dense step over ``[t, d_1, .., d_K]``, giving the target
distributions ``p_1..p_{K+1}`` (``p_i`` is dense decoding's distribution of the token after
``d_{i-1}``). Then:

* **greedy** (:func:`accept_greedy`): ``d_i`` is accepted while it is ``argmax p_i``; the next
  token is ``argmax p_{j+1}`` after ``j`` accepted drafts. The tokens are dense greedy decoding's.
* **sampling** (:func:`accept_sampled`): ``d_i`` is accepted with probability
  ``min(1, p_i(d_i) / q_i(d_i))``, in order, until the first rejection; a rejected position is
  sampled from ``norm(max(0, p_i - q_i))``, and after ``K`` accepted drafts a bonus token is sampled
  from ``p_{K+1}``. Every emitted token is distributed as ``p`` given the tokens before it
  (Leviathan et al. 2023, Chen et al. 2023), whatever ``q`` is.

:class:`Sampling` is the sampling transform both passes apply to their logits (temperature, then
top-k, then top-p, as ``transformers``' warpers do), so ``p`` and ``q`` are the distributions
dense sampling would draw from. :class:`AcceptanceStats` counts accepted drafts per round (the
measure that predicts the speed-up).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .knobs import check_value

__all__ = ["Sampling", "AcceptanceStats", "accept_greedy", "accept_sampled"]


@dataclass(frozen=True)
class Sampling:
    """Multinomial sampling from ``softmax(warp(logits))``: ``temperature`` (> 0), then the
    ``top_k`` largest logits (0 = all), then the smallest set of tokens whose probability reaches
    ``top_p`` (1.0 = all), each as ``transformers``' ``TemperatureLogitsWarper``,
    ``TopKLogitsWarper`` and ``TopPLogitsWarper`` (keeping at least one token)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        check_value("Sampling.top_k", self.top_k, int, ge=0)
        if not self.temperature > 0:
            raise ValueError(f"Sampling.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"Sampling.top_p must be in (0, 1], got {self.top_p}")

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 probabilities ``[..., V]`` of the warped ``logits [..., V]``."""
        scores = logits.float()
        if self.temperature != 1.0:
            scores = scores / self.temperature
        if self.top_k:
            kth = torch.topk(scores, min(self.top_k, scores.shape[-1]))[0][..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            ordered, order = torch.sort(scores, descending=False)
            drop = ordered.softmax(-1).cumsum(-1) <= 1 - self.top_p
            drop[..., -1:] = False
            scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        return scores.softmax(-1)


def _leading_true(ok: torch.Tensor) -> torch.Tensor:
    """``[B, K]`` bool -> ``[B]`` int64: how many leading entries of each row are True."""
    return ok.to(torch.int64).cumprod(-1).sum(-1)


def accept_greedy(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``drafts [B, K]``, the verify pass's ``target_logits [B, K+1, V]`` -> ``(accepted [B], next
    [B])``: the drafts each row accepts (leading drafts equal to the target's argmax) and the token
    after them (the target's argmax there; ties to the lower id, as ``torch.argmax``)."""
    b, k = drafts.shape
    if target_logits.shape[:2] != (b, k + 1):
        raise ValueError(f"target_logits must be [B={b}, K+1={k + 1}, V], got {tuple(target_logits.shape)}")
    target = target_logits.argmax(-1)
    accepted = _leading_true(drafts == target[:, :k])
    return accepted, target[torch.arange(b), accepted]


def accept_sampled(drafts: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``drafts [B, K]`` sampled from ``draft_probs [B, K, V]``; ``target_probs [B, K+1, V]`` ->
    ``(accepted [B], next [B])`` by the rule of the module docstring (``next``: the residual sample
    at the first rejected position, or the bonus sample from ``p_{K+1}``)."""
    b, k = drafts.shape
    v = target_probs.shape[-1]
    if draft_probs.shape != (b, k, v) or target_probs.shape != (b, k + 1, v):
        raise ValueError(f"draft_probs must be [B={b}, K={k}, V] and target_probs [B, K+1={k + 1}, V] with one V, got "
                         f"{tuple(draft_probs.shape)} and {tuple(target_probs.shape)}")
    idx = drafts.unsqueeze(-1)
    q_x = draft_probs.gather(-1, idx).squeeze(-1)
    p_x = target_probs[:, :k].gather(-1, idx).squeeze(-1)
    u = torch.rand(b, k, generator=generator, device=drafts.device)
    accepted = _leading_true(u * q_x < p_x)  # probability min(1, p/q)
    rows = torch.arange(b, device=drafts.device)
    q_pad = torch.cat([draft_probs, draft_probs.new_zeros(b, 1, v)], dim=1)  # q = 0 after K drafts: p itself
    residual = (target_probs[rows, accepted] - q_pad[rows, accepted]).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    # p <= q everywhere means p == q up to rounding, where every draft is accepted: p itself
    residual = torch.where(mass > 0, residual, target_probs[rows, accepted])
    nxt = torch.multinomial(residual, 1, generator=generator).squeeze(-1)
    return accepted, nxt


@dataclass(frozen=True)
class AcceptanceStats:
    """Accepted drafts over rounds of ``draft_len`` drafts: ``histogram[j]`` rounds (per row) accepted
    exactly ``j`` drafts (``len == draft_len + 1``)."""

    draft_len: int
    histogram: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.histogram) != self.draft_len + 1:
            raise ValueError(f"histogram needs draft_len + 1 = {self.draft_len + 1} entries, got {len(self.histogram)}")

    @classmethod
    def empty(cls, draft_len: int) -> AcceptanceStats:
        return cls(draft_len, (0,) * (draft_len + 1))

    def add(self, accepted: torch.Tensor) -> AcceptanceStats:
        """These stats plus rounds that accepted ``accepted [n]`` drafts."""
        counts = torch.bincount(accepted.to(torch.int64).cpu(), minlength=self.draft_len + 1).tolist()
        return AcceptanceStats(self.draft_len, tuple(a + c for a, c in zip(self.histogram, counts)))

    def merged(self, other: AcceptanceStats) -> AcceptanceStats:
        """The rounds of both (the same ``draft_len``)."""
        if other.draft_len != self.draft_len:
            raise ValueError(f"cannot merge acceptance of {other.draft_len} drafts into {self.draft_len}")
        return AcceptanceStats(self.draft_len, tuple(a + b for a, b in zip(self.histogram, other.histogram)))

    @property
    def rounds(self) -> int:
        return sum(self.histogram)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens one dense verify pass yields on average: accepted drafts + the one token it adds
        (in ``[1, draft_len + 1]``; 0.0 before any round)."""
        if not self.rounds:
            return 0.0
        return 1.0 + sum(j * n for j, n in enumerate(self.histogram)) / self.rounds

    @property
    def acceptance_by_position(self) -> tuple[float, ...]:
        """Per draft position ``i`` (0-based): the fraction of rounds whose first ``i + 1`` drafts
        were all accepted (empty before any round)."""
        if not self.rounds:
            return ()
        return tuple(sum(self.histogram[i + 1:]) / self.rounds for i in range(self.draft_len))
