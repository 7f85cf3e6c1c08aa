"""Lossless sparse decoding in a :class:`~kvsieve.integrations.transformers.KvsieveSession`: the
selector drafts ``K`` tokens, one dense pass over the ``K + 1`` positions verifies them
(the rule: :mod:`kvsieve.sparse.speculation`; the page: ``docs/lossless.md``).

A round, from ``L`` cached positions and the pending token ``t``:

1. ``K`` draft steps: ordinary sparse decode steps of ``t, d_1, .., d_{K-1}`` (the selector reads
   its budget of positions); each writes its position's K/V (computed from sparse attention).
2. :meth:`~kvsieve.integrations.transformers.KvsieveSession.rewind` to ``L`` (the ledger's valid
   length rolls back: ``Engine.truncate``), then one dense step over ``[t, d_1, .., d_K]``
   (``Engine.begin_step(..., dense=True)``: every selector runs ``on_append`` but chooses
   nothing), which writes dense K/V over every position the drafts wrote and its own last one.
3. The rule accepts ``j`` drafts per row; with several rows the batch keeps the fewest (``m``):
   still exact, since every row's first ``m + 1`` outcomes are outcomes of the rule (a row that
   accepted more keeps its accepted draft ``d_{m+1}``). Rewind to ``L + m + 1``: the kept
   positions hold the verify pass's dense K/V.

Selector state the drafts touched is rewritten by the verify pass: per-position state (DSA's
index keys) is written again for every drafted position, and per-page state (Quest's and
RocketKV's page summaries) is recomputed from the cache for every page the verify pass writes
into, which covers every page a draft wrote. What the verify pass itself leaves past the rolled
back length lies only beyond the valid length, where nothing reads it, and the next step's write
into that page recomputes the page from the cache before it is read.

The prompt's step is dense too (``dense=True``), so a selector that also selects in the context
phase does not change the K/V the verify pass reads. Refused when the session is configured
(:func:`speculation_refusal`): ``K < 1``, ``K`` above a selector's budget in tokens, a selector
that evicts prompt tokens (the verify pass would read the evicted cache), a config whose plans
select in no generation step (nothing to draft with), prefix caching (blocks a draft fills would
be named and reused with sparse-computed K/V).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...sparse import LayerPlan
from ...sparse.speculation import AcceptanceStats, Sampling, accept_greedy, accept_sampled
from .generate_args import GenerateRequest, read_generate_call

__all__ = ["SpeculativeOutput", "SessionSpeculation", "speculation_refusal", "speculative_decode", "untied_mismatch"]

#: the largest gap between dense decoding's two top fp32 logits that a K+1-token verify pass may
#: resolve the other way than one-token steps (their rounding differs by far less)
TIE_TOLERANCE = 1e-3


@dataclass(frozen=True)
class SpeculativeOutput:
    """``tokens [B, n]``: the new tokens; ``acceptance``: the accepted drafts of the call's full
    rounds (``K`` drafts; rows still generating)."""

    tokens: torch.Tensor
    acceptance: AcceptanceStats


def _budget_tokens(plan: LayerPlan) -> int | None:
    """The positions a plan's selector reads per query by its budget knob (``None``: no knob in
    tokens, pages or blocks)."""
    knob = type(plan.selector).budget
    if knob is None or knob.unit == "sparsity":
        return None
    value = int(getattr(plan.selector.config, knob.field))
    return value * int(getattr(plan.selector.config, knob.unit_size_field)) if knob.unit in ("pages", "blocks") \
        else value


def speculation_refusal(speculate: int, plans: Sequence[LayerPlan | None], *, prefix_caching: bool) -> str | None:
    """Why a session cannot draft ``speculate`` tokens per round with these per-layer plans, or ``None``."""
    if isinstance(speculate, bool) or not isinstance(speculate, int) or speculate < 1:
        return f"speculate must be an int >= 1 (draft tokens per round), got {speculate!r}"
    active = [p for p in plans if p is not None]
    evicting = sorted({p.selector.name for p in active if p.selector.capabilities.evicts})
    if evicting:
        return (f"speculate: selector(s) {evicting} evict prompt tokens, so the dense verify pass would read the "
                "evicted cache rather than what dense decoding reads")
    if not any("generation" in p.phases for p in active):
        names = sorted({p.selector.name for p in active}) or "none (dense)"
        return (f"speculate: no layer's plan selects in the generation phase (selectors: {names}), so the drafts "
                "would be dense; choose a decode-phase selector")
    for p in active:
        budget = _budget_tokens(p)
        if budget is not None and speculate > budget:
            return (f"speculate={speculate} exceeds selector {p.selector.name!r}'s budget of {budget} positions "
                    f"({type(p.selector).budget.field}); draft at most that many tokens per round")
    if prefix_caching:
        return ("speculate: prefix_caching would name and reuse blocks the drafts filled with sparse-computed K/V; "
                "build the session without prefix_caching")
    return None


def _pick(logits: torch.Tensor, sampling: Sampling | None, generator: torch.Generator | None
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The next token of each row ``[B]`` from ``logits [B, V]`` and, when sampling, its distribution."""
    if sampling is None:
        return logits.argmax(-1), None
    probs = sampling.probs(logits)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1), probs


@torch.inference_mode()
def speculative_decode(session: Any, request: GenerateRequest, k: int,
                       generator: torch.Generator | None = None) -> SpeculativeOutput:
    """Prefill ``request.input_ids`` in ``session`` and decode up to ``request.max_new_tokens`` tokens
    by drafting ``k`` per round (module docstring). ``session`` offers ``run_logits(ids, new_requests=,
    keep=, dense=)``, ``decode``, ``rewind`` and ``num_cached_positions``."""
    b = request.input_ids.shape[0]
    logits = session.run_logits(request.input_ids, new_requests=True, keep=1, dense=True)[:, -1]
    eos = torch.tensor(request.eos_token_ids, dtype=torch.int64, device=logits.device)
    done = torch.zeros(b, dtype=torch.bool, device=logits.device)
    out: list[torch.Tensor] = []
    stats = AcceptanceStats.empty(k)

    def emit(tok: torch.Tensor) -> bool:
        """Append a token per row (finished rows: padding); True when generation is over."""
        nonlocal done
        if request.pad_token_id is not None:
            tok = torch.where(done, request.pad_token_id, tok)
        out.append(tok)
        done = done | torch.isin(tok, eos)
        return len(out) >= request.max_new_tokens or bool(done.all())

    tok = _pick(logits, request.sampling, generator)[0]
    finished = emit(tok)
    while not finished:
        kk = min(k, request.max_new_tokens - len(out) - 1)
        start = session.num_cached_positions
        try:
            drafts, draft_probs, x = [], [], tok
            for _ in range(kk):
                x, q = _pick(session.decode(x), request.sampling, generator)
                drafts.append(x)
                draft_probs.append(q)
            session.rewind(start)
            target = session.run_logits(torch.stack([tok, *drafts], dim=1), new_requests=False, keep=kk + 1,
                                        dense=True)
        except BaseException:
            if session.num_cached_positions > start:
                session.rewind(start)
            raise
        d = torch.stack(drafts, dim=1) if kk else tok.new_zeros(b, 0)
        if request.sampling is None:
            accepted, nxt = accept_greedy(d, target)
        else:
            q = torch.stack(draft_probs, dim=1) if kk else target.new_zeros(b, 0, target.shape[-1])
            accepted, nxt = accept_sampled(d, q, request.sampling.probs(target), generator)
        if kk == k:
            stats = stats.add(accepted[~done])
        m = int(accepted.min())
        session.rewind(start + m + 1)
        tok = torch.where(accepted > m, d[:, min(m, kk - 1)], nxt) if m < kk else nxt
        for t in [*d[:, :m].unbind(1), tok]:
            finished = emit(t)
            if finished:
                break
    return SpeculativeOutput(torch.stack(out, dim=1), stats)


def untied_mismatch(model: torch.nn.Module, prompt_len: int, dense: torch.Tensor, out: torch.Tensor,
                    tol: float = TIE_TOLERANCE) -> str | None:
    """Check greedy tokens ``out [B, n]`` against dense greedy decoding's ``dense [B, n]`` (both with
    the prompt's first ``prompt_len`` tokens): ``None`` when every row equals dense up to its first
    difference and there dense decoding's two top logits (the model's own forward on the dense
    tokens before it) are within ``tol``; else what differs."""
    if out.shape[0] != dense.shape[0] or not torch.equal(out[:, :prompt_len], dense[:, :prompt_len]):
        return f"rows or prompts differ: {tuple(out.shape)} against {tuple(dense.shape)}"
    for row in range(dense.shape[0]):
        n = min(out.shape[1], dense.shape[1])
        diff = (out[row, :n] != dense[row, :n]).nonzero()
        if len(diff) == 0:
            if out.shape[1] != dense.shape[1]:
                return f"row {row}: {out.shape[1]} tokens against dense decoding's {dense.shape[1]}"
            continue
        first = int(diff[0])
        with torch.inference_mode():
            top = model(dense[row: row + 1, :first]).logits[0, -1].float().topk(2).values
        gap = float(top[0] - top[1])
        if gap >= tol:
            return (f"row {row}, position {first}: token {int(out[row, first])} against dense {int(dense[row, first])}, "
                    f"whose two top logits are {gap:.3g} apart (>= {tol}: not a rounding tie)")
    return None


class SessionSpeculation:
    """The speculative methods of a session; the session sets ``speculate`` (draft tokens per round,
    ``None`` = off) and offers the stepping :func:`speculative_decode` uses."""

    speculate: int | None
    _acceptance: AcceptanceStats | None

    def speculative_generate(self, input_ids: torch.Tensor, max_new_tokens: int, *, sampling: Sampling | None = None,
                             eos_token_id: int | None = None, pad_token_id: int | None = None,
                             generator: torch.Generator | None = None) -> SpeculativeOutput:
        """Start new requests with ``input_ids [B, S]`` and decode up to ``max_new_tokens`` tokens, the
        selector drafting ``speculate`` tokens per round and a dense pass verifying them: greedy
        (``sampling=None``) gives dense greedy decoding's tokens, ``sampling`` dense sampling's
        distribution. Rows that produced ``eos_token_id`` are padded with ``pad_token_id`` (default:
        the eos id); returns the new tokens and the call's :class:`AcceptanceStats`."""
        if self.speculate is None:
            raise ValueError("speculative_generate: the session was built without speculate=K")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids must be [batch, seq_len >= 1], got {tuple(input_ids.shape)}")
        eos = () if eos_token_id is None else (int(eos_token_id),)
        pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else None)
        return self._speculate(GenerateRequest(input_ids, max_new_tokens, sampling, eos, pad), generator)

    def generate_call(self, args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
        """``model.generate(*args, **kwargs)`` decoded speculatively (the settings it honours and refuses:
        :mod:`.generate_args`); returns prompt and new tokens ``[B, S + n]`` as ``generate`` does."""
        request = read_generate_call(self.model, args, kwargs)
        new = self._speculate(request, None).tokens
        return torch.cat([request.input_ids.to(new.device), new], dim=1)

    def acceptance(self) -> AcceptanceStats | None:
        """The accepted drafts of every speculative call since the last ``reset_stats`` (``None``
        when the session does not speculate)."""
        return self._acceptance

    def _speculate(self, request: GenerateRequest, generator: torch.Generator | None) -> SpeculativeOutput:
        out = speculative_decode(self, request, self.speculate, generator)
        self._acceptance = self._acceptance.merged(out.acceptance)
        return out
