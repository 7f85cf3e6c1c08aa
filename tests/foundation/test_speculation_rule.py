"""The speculative rule (:mod:`kvsieve.sparse.speculation`) against plain references: greedy
acceptance by hand, the sampling transform against transformers' own warpers, and the sampled
output distribution against the target's on a 4-token vocabulary, where two deliberately wrong
rules fail the same check."""
from __future__ import annotations

import pytest
import torch

from kvsieve.sparse.speculation import AcceptanceStats, Sampling, accept_greedy, accept_sampled

V, N = 4, 200_000


def test_greedy_accepts_the_leading_argmax_matches_and_takes_the_target_token_after_them() -> None:
    target = torch.full((3, 4, 5), -1.0)
    for row, best in enumerate(([1, 2, 3, 4], [1, 0, 3, 4], [0, 2, 3, 1])):
        target[row, torch.arange(4), torch.tensor(best)] = 1.0
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    accepted, nxt = accept_greedy(drafts, target)
    assert accepted.tolist() == [3, 1, 0] and nxt.tolist() == [4, 0, 0]
    with pytest.raises(ValueError, match="target_logits must be"):
        accept_greedy(drafts, target[:, :3])


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.7, top_k=5), Sampling(top_p=0.8),
                                      Sampling(temperature=1.3, top_k=50, top_p=0.9)])
def test_sampling_probs_equal_transformers_warpers(sampling: Sampling) -> None:
    tr = pytest.importorskip("transformers")
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1)) * 3
    scores = logits.clone()
    warpers = []
    if sampling.temperature != 1.0:
        warpers.append(tr.TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k:
        warpers.append(tr.TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        warpers.append(tr.TopPLogitsWarper(sampling.top_p))
    for w in warpers:
        scores = w(None, scores)
    assert torch.equal(sampling.probs(logits), scores.softmax(-1))
    assert torch.equal(sampling.probs(logits[None])[0], scores.softmax(-1))  # [B, K, V] as [B, V]


def test_sampling_refuses_settings_it_cannot_apply() -> None:
    for bad, field in ((dict(temperature=0.0), "temperature"), (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p")):
        with pytest.raises(ValueError, match=field):
            Sampling(**bad)


def _tables() -> tuple[torch.Tensor, ...]:
    """A two-token process on V tokens: draft q1, q2[x1]; target p1, p2[x1], p3[x1, x2] (all different)."""
    g = torch.Generator().manual_seed(7)

    def dist(*shape: int) -> torch.Tensor:
        return (torch.rand(*shape, V, generator=g) * 3).softmax(-1)

    return dist(), dist(V), dist(), dist(V), dist(V, V)


def _outputs(rule) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """Run ``rule`` on N rows with K = 2 drafts; returns (o1, o2, o3) with -1 where not emitted."""
    q1, q2, p1, p2, p3 = _tables()
    g = torch.Generator().manual_seed(3)
    x1 = torch.multinomial(q1.expand(N, V), 1, generator=g).squeeze(1)
    x2 = torch.multinomial(q2[x1], 1, generator=g).squeeze(1)
    drafts = torch.stack([x1, x2], 1)
    q = torch.stack([q1.expand(N, V), q2[x1]], 1)
    p = torch.stack([p1.expand(N, V), p2[x1], p3[x1, x2]], 1)
    accepted, nxt = rule(drafts, q, p, g)
    none = torch.full_like(x1, -1)
    o1 = torch.where(accepted >= 1, x1, nxt)
    o2 = torch.where(accepted >= 2, x2, torch.where(accepted == 1, nxt, none))
    o3 = torch.where(accepted == 2, nxt, none)
    return o1, o2, o3


def _worst_deviation(rule) -> float:  # noqa: ANN001
    """The largest total-variation distance between an emitted token's empirical distribution (given
    the tokens before it) and the target's, over o1, o2 | o1 and o3 | (o1, o2)."""
    _, _, p1, p2, p3 = _tables()
    o1, o2, o3 = _outputs(rule)

    def tv(sample: torch.Tensor, target: torch.Tensor) -> float:
        if sample.numel() < 2000:
            return 0.0
        return 0.5 * float((torch.bincount(sample, minlength=V).float() / sample.numel() - target).abs().sum())

    worst = tv(o1, p1)
    for a in range(V):
        worst = max(worst, tv(o2[(o1 == a) & (o2 >= 0)], p2[a]))
        for b in range(V):
            worst = max(worst, tv(o3[(o1 == a) & (o2 == b) & (o3 >= 0)], p3[a, b]))
    return worst


def test_sampled_outputs_follow_the_target_and_wrong_rules_fail_the_same_check() -> None:
    # sampling noise of a TV distance over 4 tokens with >= 2000 samples: about 0.02 at worst
    assert _worst_deviation(accept_sampled) < 0.03

    def resample_from_p(drafts, q, p, g):  # noqa: ANN001, ANN202  a rejected position drawn from p, not p - q
        accepted, _ = accept_sampled(drafts, q, p, g)
        return accepted, torch.multinomial(p[torch.arange(len(drafts)), accepted], 1, generator=g).squeeze(1)

    def accept_always(drafts, q, p, g):  # noqa: ANN001, ANN202  every draft kept: the output is q's
        return accept_sampled(drafts, torch.zeros_like(q), p, g)

    assert _worst_deviation(resample_from_p) > 0.06
    assert _worst_deviation(accept_always) > 0.06


def test_draft_equal_to_target_is_always_accepted() -> None:
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    drafts = torch.multinomial(p.expand(1000, V), 2, replacement=True, generator=torch.Generator().manual_seed(0))
    q = p.expand(1000, 2, V)
    accepted, _ = accept_sampled(drafts, q, p.expand(1000, 3, V).contiguous())
    assert bool((accepted == 2).all())


def test_acceptance_stats_count_rounds_by_accepted_drafts() -> None:
    stats = AcceptanceStats.empty(3).add(torch.tensor([0, 3, 3, 1]))
    assert stats.histogram == (1, 1, 0, 2) and stats.rounds == 4
    assert stats.mean_accepted_length == pytest.approx(1 + 7 / 4)
    assert stats.acceptance_by_position == pytest.approx((3 / 4, 2 / 4, 2 / 4))
    assert stats.merged(stats).histogram == (2, 2, 0, 4)
    assert AcceptanceStats.empty(2).mean_accepted_length == 0.0 and AcceptanceStats.empty(2).acceptance_by_position == ()
    with pytest.raises(ValueError, match="merge"):
        stats.merged(AcceptanceStats.empty(2))
