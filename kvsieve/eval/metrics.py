"""Scores and intervals (task metrics) and attention-fidelity measures on one layer's step."""
from __future__ import annotations

import math
import re

import torch

__all__ = ["string_match_all", "string_match_part", "digit_prefix_match", "mean_ci95", "fidelity_metrics",
           "kl_divergence"]


def _norm(s: str) -> str:
    return " ".join(s.lower().split())


def string_match_all(prediction: str, answers: list[str]) -> float:
    """RULER's ``string_match_all``: fraction of ``answers`` contained in ``prediction`` (case-insensitive)."""
    if not answers:
        raise ValueError("answers must not be empty")
    p = _norm(prediction)
    return sum(_norm(a) in p for a in answers) / len(answers)


def string_match_part(prediction: str, answers: list[str]) -> float:
    """RULER's ``string_match_part``: 1 if any answer is contained in ``prediction``."""
    if not answers:
        raise ValueError("answers must not be empty")
    p = _norm(prediction)
    return float(any(_norm(a) in p for a in answers))


def digit_prefix_match(prediction: str, answer: str) -> float:
    """Partial credit for a numeric answer: the longest common prefix of ``answer`` and any number
    in ``prediction``, over ``len(answer)`` (RocketKV's partial match, reimplemented; every number is
    tried, so list-style answers like ``":\n1. 6733903"`` get full credit)."""
    if not answer:
        raise ValueError("answer must not be empty")
    best = 0
    for found in re.finditer(r"\d+", prediction):
        got, n = found.group(0), 0
        while n < min(len(got), len(answer)) and got[n] == answer[n]:
            n += 1
        best = max(best, n)
    return best / len(answer)


def mean_ci95(values: list[float], binary: bool | None = None) -> tuple[float, float, float]:
    """``(mean, low, high)``: Wilson's interval for 0/1 scores (``binary``; ``None``: when every
    value is 0 or 1), else a normal interval ``mean +- 1.96 s/sqrt(n)`` (``nan`` bounds for n = 1:
    one continuous value says nothing of its spread); all ``nan`` for no values."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan, math.nan
    m = sum(values) / n
    z = 1.96
    if binary is None:
        binary = all(v in (0.0, 1.0) for v in values)
    if binary:
        if any(v not in (0.0, 1.0) for v in values):
            raise ValueError(f"binary scores must be 0 or 1, got {sorted(set(values))}")
        den = 1 + z * z / n
        center = (m + z * z / (2 * n)) / den
        half = z * math.sqrt(m * (1 - m) / n + z * z / (4 * n * n)) / den
        return m, max(0.0, center - half), min(1.0, center + half)
    if n == 1:
        return m, math.nan, math.nan
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    half = z * sd / math.sqrt(n)
    return m, m - half, m + half


def fidelity_metrics(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, out: torch.Tensor,
                     sm_scale: float) -> dict[str, float]:
    """How well one sparse attention step approximates dense attention on the same inputs.

    q ``[n, Hq, D]``, k/v ``[L, Hkv, D]`` (the request's whole cache), ``mask`` bool ``[Hkv, n, L]``
    (the positions attended), ``out [n, Hq, D]`` (the sparse output). Returns the means over rows
    and heads of: ``mass_recall`` (dense softmax mass on the attended set), ``rel_error``
    (``|out - dense| / |dense|``) and ``topk_overlap`` (share of the attended set that is among the
    exact top-|set| positions by group-summed dense probability).
    """
    n, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    s = torch.einsum("nhgd,lhd->hgnl", q.float().view(n, hkv, g, d), k.float()) * sm_scale
    # row r is the (L - n + r)-th position: it sees positions < L - n + r + 1
    lens = torch.arange(k.shape[0]).unsqueeze(0) < (k.shape[0] - n + 1 + torch.arange(n)).unsqueeze(1)  # [n, L]
    s = s.masked_fill(~lens[None, None], float("-inf"))
    p = torch.softmax(s, dim=-1)  # [Hkv, g, n, L]
    m = mask.unsqueeze(1).float() * lens[None, None]
    recall = (p * m).sum(-1).mean()
    dense = torch.einsum("hgnl,lhd->nhgd", p, v.float()).reshape(n, hq, -1)
    rel = ((out.float() - dense).norm(dim=-1) / dense.norm(dim=-1).clamp_min(1e-12)).mean()
    group = p.sum(1)  # [Hkv, n, L]
    counts = (mask & lens[None]).sum(-1)  # [Hkv, n]
    overlap = []
    for h in range(hkv):
        for r in range(n):
            c = int(counts[h, r])
            if c == 0:
                continue
            top = group[h, r].topk(c).indices
            overlap.append(float(mask[h, r, top].float().mean()))
    return {"mass_recall": float(recall), "rel_error": float(rel),
            "topk_overlap": sum(overlap) / len(overlap) if overlap else 1.0}


def kl_divergence(dense_logits: torch.Tensor, sparse_logits: torch.Tensor) -> float:
    """Mean ``KL(softmax(dense) || softmax(sparse))`` over rows of ``[n, V]`` logits, in nats."""
    lp = torch.log_softmax(dense_logits.float(), dim=-1)
    lq = torch.log_softmax(sparse_logits.float(), dim=-1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())
