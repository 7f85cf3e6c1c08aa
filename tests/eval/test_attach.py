"""A selector installed after the prompt is in the cache: rebuilt from the cache (Quest's page
summaries, so the run equals one where Quest saw the prefill) or refused with the cache unchanged;
and the eval shares the dense prefill exactly with the selectors that can be installed late."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsieve import SparseAttentionConfig
from kvsieve.eval.run_plan import shares_prefill
from kvsieve.integrations.transformers import KvsieveSession
from kvsieve.selectors.common.page_selector import PageSelectorBase
from kvsieve.sparse import Capabilities, SparseSelector, attach_refusal, create_selector, register_selector
from kvsieve.sparse.registry import SELECTORS

QUEST = SparseAttentionConfig("quest", {"budget": 16, "page_size": 8, "summary_dtype": "float32"},
                              phases=("generation",))


def _decode(session: KvsieveSession, logits: torch.Tensor, n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``n`` greedy steps; the tokens and each step's logits."""
    toks, all_logits = [], []
    for _ in range(n):
        tok = logits.argmax(-1)
        toks.append(tok)
        logits = session.decode(tok)
        all_logits.append(logits)
    return torch.stack(toks, 1), all_logits


def test_quest_installed_after_dense_prefill_equals_quest_from_the_start(tiny_model, prompt_ids):
    ref = KvsieveSession(tiny_model, QUEST, max_tokens=128)
    ref_toks, ref_logits = _decode(ref, ref.prefill(prompt_ids), 6)
    assert all(f < 0.6 for f in ref.attended_fraction("generation"))  # it really selects

    late = KvsieveSession(tiny_model, None, max_tokens=128)
    logits = late.prefill(prompt_ids)
    late.set_config(QUEST)
    toks, late_logits = _decode(late, logits, 6)
    assert torch.equal(toks, ref_toks)
    for a, b in zip(late_logits, ref_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_without_the_rebuild_the_late_quest_reads_stale_summaries(tiny_model, prompt_ids, monkeypatch):
    """The control: the same late install with ``on_attach`` a no-op gives other logits, so the
    test above can fail."""
    ref = KvsieveSession(tiny_model, QUEST, max_tokens=128)
    _, ref_logits = _decode(ref, ref.prefill(prompt_ids), 3)
    monkeypatch.setattr(PageSelectorBase, "on_attach", lambda self, inputs, requests: None)
    late = KvsieveSession(tiny_model, None, max_tokens=128)
    logits = late.prefill(prompt_ids)
    late.set_config(QUEST)
    _, late_logits = _decode(late, logits, 3)
    assert any(not torch.equal(a, b) for a, b in zip(late_logits, ref_logits))


@pytest.fixture
def stateful_selector():
    """A selector that builds per-token state in on_append (a token count) and has no on_attach."""
    saved = dict(SELECTORS._classes)

    @register_selector
    class _Stateful(SparseSelector):
        name = "test_stateful_attach"
        capabilities = Capabilities(phases=frozenset({"generation"}))

        def on_append(self, inputs) -> None:  # noqa: ANN001
            self.seen = getattr(self, "seen", 0) + inputs.metadata.num_tokens

        def predict_attn(self, inputs):  # noqa: ANN001
            return None

    yield _Stateful
    SELECTORS._classes.clear()
    SELECTORS._classes.update(saved)


def test_stateful_selector_without_rebuild_is_refused_and_the_cache_is_unchanged(tiny_model, prompt_ids,
                                                                                stateful_selector):
    sel = create_selector("test_stateful_attach")
    assert "on_append" in attach_refusal(sel)
    assert attach_refusal(create_selector("quest")) is None
    assert attach_refusal(create_selector("dsa")) is not None  # index keys come from hidden states
    session = KvsieveSession(tiny_model, None, max_tokens=128)
    logits = session.prefill(prompt_ids)
    dense_next = session.decode(logits.argmax(-1))
    session.rewind(prompt_ids.shape[1])
    before = (session.num_cached_positions, session.cache.valid_len(0))
    session.set_config(SparseAttentionConfig("test_stateful_attach", {}, phases=("generation",)))
    with pytest.raises(ValueError, match=r"request 0 holds 48 positions.*test_stateful_attach.*on_append"):
        session.decode(logits.argmax(-1))
    assert (session.num_cached_positions, session.cache.valid_len(0)) == before
    session.set_config(None)
    torch.testing.assert_close(session.decode(logits.argmax(-1)), dense_next, rtol=0, atol=0)


def test_a_stateful_selector_from_the_prefill_on_is_not_refused(tiny_model, prompt_ids, stateful_selector):
    session = KvsieveSession(tiny_model, SparseAttentionConfig("test_stateful_attach", {}, phases=("generation",)),
                             max_tokens=128)
    session.generate(prompt_ids, 3)
    assert session.num_cached_positions == prompt_ids.shape[1] + 2


@pytest.mark.parametrize("name, params, phases, shares", [
    ("quest", {"budget": 64}, ("generation",), True),
    ("oracle_topk", {"budget": 64}, ("generation",), True),
    ("block_select", {"topk_blocks": 4, "scoring": "summary"}, ("generation",), True),
    ("block_select", {"topk_blocks": 4}, ("context", "generation"), False),
    ("dsa", {"index_topk": 64}, ("generation",), False),
    ("snapkv", {"prompt_budget": 64}, ("context",), False),
])
def test_which_runs_share_the_dense_prefill(name, params, phases, shares):
    assert shares_prefill(SparseAttentionConfig(name, params, phases=phases)) is shares


def test_on_attach_gets_only_the_requests_that_began_before(tiny_model, monkeypatch):
    """Two rows prefilled densely, then Quest: both rows are attached once, at the first decode."""
    calls = []
    orig = PageSelectorBase.on_attach

    def spy(self, inputs, requests):  # noqa: ANN001
        calls.append((inputs.layer_idx, np.asarray(requests).tolist()))
        orig(self, inputs, requests)

    monkeypatch.setattr(PageSelectorBase, "on_attach", spy)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(5))
    session = KvsieveSession(tiny_model, None, max_tokens=128, max_batch=2)
    logits = session.prefill(ids)
    session.set_config(QUEST)
    _decode(session, logits, 3)
    assert calls == [(0, [0, 1]), (1, [0, 1])]
