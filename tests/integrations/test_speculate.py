"""Lossless sparse decoding (``kvsieve.apply(..., speculate=K)``): the selector drafts, one dense
pass verifies. Greedy tokens equal the model's own dense ``generate`` (where one differs, dense
decoding's two top logits must be within rounding there); rejected drafts leave the cache, the
page summaries and DSA's index keys as a run that never drafted; what the rule cannot honour is
refused by name with the model untouched."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from families import build

import kvsieve
from kvsieve import SparseAttentionConfig
from kvsieve.eval.model import ByteTokenizer, load_model, tiny_random_llama
from kvsieve.integrations.transformers import KvsieveSession, attach_dsa_indexer
from kvsieve.integrations.transformers.speculate import untied_mismatch

def assert_dense_tokens(model: torch.nn.Module, ids: torch.Tensor, ref: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` equals dense ``ref`` up to the first position where they differ; there dense decoding's
    two top logits must be within rounding (a tie the verify pass's rounding may break the other way)."""
    assert untied_mismatch(model, ids.shape[1], ref, out) is None


def _prompt(n: int, batch: int = 1) -> torch.Tensor:
    text = "Sparse attention reads a few pages of the cache; dense attention reads them all. " * 20
    ids = torch.tensor(ByteTokenizer().encode(text)[:n])
    return torch.stack([ids.roll(7 * r) for r in range(batch)])


@pytest.mark.parametrize("k, batch", [(1, 1), (3, 2), (6, 1)])
def test_greedy_generate_equals_dense_generate_tiny_random(k: int, batch: int) -> None:
    model = tiny_random_llama()
    ids = _prompt(100, batch)
    ref = model.generate(ids, max_new_tokens=20, do_sample=False)
    with kvsieve.apply(model, "quest", budget=32, page_size=16, speculate=k) as session:
        out = model.generate(ids, max_new_tokens=20, do_sample=False)
    assert out.shape == ref.shape
    assert_dense_tokens(model, ids, ref, out)
    stats = session.acceptance()
    assert stats.draft_len == k and stats.rounds > 0 and 1 <= stats.mean_accepted_length <= k + 1


def test_greedy_generate_equals_dense_generate_smollm2() -> None:
    lm = load_model("smollm2")
    text = "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg " * 12
    ids = torch.tensor([lm.tokenizer.encode(text)])[:, :240]
    ref = lm.model.generate(ids, max_new_tokens=16, do_sample=False)
    with kvsieve.apply(lm.model, "quest", budget=64, speculate=4) as session:
        out = lm.model.generate(ids, max_new_tokens=16, do_sample=False)
        stats = session.acceptance()
        frac = session.attended_fraction("generation")
    assert_dense_tokens(lm.model, ids, ref, out)
    assert stats.rounds > 0 and len(stats.acceptance_by_position) == 4
    assert all(f < 1.0 for f in frac)  # the drafts did read fewer positions


def test_sampling_with_top_k_1_is_dense_greedy_and_eos_pads_like_generate() -> None:
    """``do_sample=True, top_k=1`` leaves one token per step: the sampled path must give greedy's
    tokens; an ``eos_token_id`` hit on the way pads the row as ``generate`` does."""
    model = tiny_random_llama()
    ids = _prompt(90, 2)
    ref = model.generate(ids, max_new_tokens=16, do_sample=False)
    eos = int(ref[0, ids.shape[1] + 5])
    ref_eos = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=0)
    with kvsieve.apply(model, "quest", budget=32, page_size=16, speculate=3):
        out = model.generate(ids, max_new_tokens=16, do_sample=True, top_k=1)
        out_eos = model.generate(ids, max_new_tokens=16, do_sample=True, top_k=1, eos_token_id=eos, pad_token_id=0)
    assert_dense_tokens(model, ids, ref, out)
    assert torch.equal(out_eos, ref_eos)


def _valid_state(session: KvsieveSession) -> dict[str, torch.Tensor]:
    """Per layer: the K/V of every valid position and every auxiliary pool over the valid positions
    (position-indexed pools) or the pages holding them (page summaries), of request 0."""
    cache = session.cache
    n, blocks = cache.valid_len(0), cache.block_ids(0)
    state: dict[str, torch.Tensor] = {}
    for layer in range(session.num_layers):
        for name, pool in (("k", cache.k_cache(layer)), ("v", cache.v_cache(layer))):
            state[f"{name}{layer}"] = pool[blocks].transpose(1, 2).flatten(0, 1)[:n]
        for name, pools in cache.aux_pools.items():
            rows = pools[layer][blocks]
            if name.startswith("page_summary"):  # [blocks, Hkv, pages, 2, D]
                page = cache.tokens_per_block // rows.shape[2]
                state[f"{name}{layer}"] = rows.transpose(1, 2).flatten(0, 1)[: -(-n // page)]
            else:  # [blocks, tokens_per_block, ...]
                state[f"{name}{layer}"] = rows.flatten(0, 1)[:n]
    return state


def _session(model: torch.nn.Module, selector: str) -> KvsieveSession:
    from kvsieve.selectors.dsa.projections import IndexerProjections

    params = dict(budget=32, page_size=16) if selector == "quest" else dict(n_heads=2, head_dim=16, rope_dim=8,
                                                                            index_topk=24)
    session = KvsieveSession(model, SparseAttentionConfig(selector, params), max_tokens=256, speculate=4)
    if selector == "dsa":
        torch.manual_seed(0)
        session.layers[0].plan.selector.set_projections({i: IndexerProjections(64, 2, 16, 8) for i in range(2)})
        attach_dsa_indexer(session)
    return session


def _end_state(session: KvsieveSession) -> tuple[dict[str, torch.Tensor], int, int]:
    state = {name: t.clone() for name, t in _valid_state(session).items()}
    return state, session.cache.valid_len(0), session.cache.allocator.num_free


@pytest.mark.parametrize("selector", ["quest", "dsa"])
def test_rejected_drafts_leave_the_state_of_a_run_that_never_drafted(selector: str) -> None:
    """Run speculatively, recording the dense steps and rollbacks; then run only those (no draft) in a
    fresh session: the K/V, the selector's pools (page summaries / index keys) over the valid
    positions, the valid length and the free blocks are equal."""
    model = tiny_random_llama()
    ids = _prompt(120)
    calls: list[tuple] = []
    with _session(model, selector) as spec:
        run, rewind = spec.run_logits, spec.rewind
        spec.run_logits = lambda ids, **kw: calls.append(("run", ids, kw)) or run(ids, **kw)
        spec.rewind = lambda n: calls.append(("rewind", n)) or rewind(n)
        spec.speculative_generate(ids, 40)
        assert spec.acceptance().histogram[:4] != (0,) * 4, "no draft was rejected: nothing to roll back"
        drafted = _end_state(spec)
    with _session(model, selector) as fresh:
        for call in calls:
            if call[0] == "run" and call[2].get("dense"):  # the prompt's and the verify passes (not the drafts)
                fresh.run_logits(call[1], **call[2])
            elif call[0] == "rewind" and call[1] <= fresh.num_cached_positions:  # fresh holds no drafts to drop
                fresh.rewind(call[1])
        never = _end_state(fresh)
    (a, len_a, free_a), (b, len_b, free_b) = drafted, never
    assert a.keys() == b.keys() and any(name.startswith(("page_summary", "dsa")) for name in a)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert len_a == len_b and free_a == free_b  # no block left held by a draft
    assert sum(1 for c in calls if c[0] == "run" and not c[2].get("dense")) > 0  # the drafts ran in spec only


def _unchanged(model: torch.nn.Module) -> None:
    assert model.config._attn_implementation == "eager"
    assert not any(hasattr(layer.self_attn, "kvsieve_session") for layer in model.model.layers)


@pytest.mark.parametrize("selector, params, k, field", [
    ("quest", dict(budget=32, page_size=16), 0, "speculate must be an int >= 1"),
    ("quest", dict(budget=32, page_size=16), 33, "speculate=33 exceeds selector 'quest'.s budget of 32 positions"),
    ("snapkv", dict(), 2, r"selector\(s\) \['snapkv'\] evict"),
    ("rocketkv", dict(), 2, r"selector\(s\) \['rocketkv'\] evict"),
    (None, dict(), 2, "no layer's plan selects in the generation phase"),
])
def test_apply_refuses_what_it_cannot_draft_with_and_leaves_the_model(selector, params, k, field) -> None:  # noqa: ANN001
    model, _ = build("llama")
    with pytest.raises(ValueError, match=field):
        kvsieve.apply(model, selector, speculate=k, **params)
    _unchanged(model)


def test_prefix_caching_and_released_windows_are_refused() -> None:
    model, _ = build("llama")
    cfg = SparseAttentionConfig("quest", dict(budget=32, page_size=16))
    with pytest.raises(ValueError, match="prefix_caching"):
        KvsieveSession(model, cfg, prefix_caching=True, speculate=2)
    _unchanged(model)
    gemma, _ = build("gemma3")
    with pytest.raises(ValueError, match="release_windows=False"):
        KvsieveSession(gemma, SparseAttentionConfig("oracle_topk", dict(budget=4)), speculate=2)
    assert gemma.config._attn_implementation == "eager"


def test_set_config_refuses_an_evicting_selector_and_keeps_the_old_plans() -> None:
    model, _ = build("llama")
    with kvsieve.apply(model, "quest", budget=32, page_size=16, speculate=2) as session:
        plans = [layer.plan for layer in session.layers]
        with pytest.raises(ValueError, match="evict"):
            session.set_config(SparseAttentionConfig("snapkv", {}))
        assert [layer.plan for layer in session.layers] == plans


def test_windowed_model_speculates_with_its_windows_kept() -> None:
    """Gemma 3's windowed layers keep their blocks (apply turns release_windows off under speculate),
    and the tokens are the dense model's."""
    model, _ = build("gemma3")
    ids = torch.randint(3, 96, (1, 60), generator=torch.Generator().manual_seed(0))
    ref = model.generate(ids, max_new_tokens=12, do_sample=False)
    with kvsieve.apply(model, "oracle_topk", budget=4, speculate=3):
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert_dense_tokens(model, ids, ref, out)


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_beams=2), "num_beams"),
    (dict(repetition_penalty=1.3), "repetition_penalty"),
    (dict(min_new_tokens=3), "min_new_tokens"),
    (dict(do_sample=True, min_p=0.1), "min_p"),
    (dict(streamer=object()), "streamer"),
    (dict(logits_processor=[]), "logits_processor"),
    (dict(output_scores=True, return_dict_in_generate=True), "output_scores"),
    (dict(attention_mask=torch.tensor([[0] + [1] * 39])), "attention_mask"),
    (dict(token_type_ids=torch.zeros(1, 40, dtype=torch.long)), "token_type_ids"),
])
def test_generate_refuses_settings_the_rule_cannot_honour(kwargs, field) -> None:  # noqa: ANN001
    model, _ = build("llama")
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    with kvsieve.apply(model, "quest", budget=32, page_size=16, speculate=2) as session:
        with pytest.raises(ValueError, match=field):
            model.generate(ids, max_new_tokens=4, **kwargs)
        assert session.live_rows == 0 and session.acceptance().rounds == 0  # nothing ran
        assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 44)


def test_session_method_returns_tokens_and_acceptance() -> None:
    model = tiny_random_llama()
    ids = _prompt(100)
    with KvsieveSession(model, SparseAttentionConfig("quest", dict(budget=32, page_size=16)), speculate=4) as session:
        out = session.speculative_generate(ids, 12, generator=torch.Generator().manual_seed(0))
        assert out.tokens.shape == (1, 12) and out.acceptance.draft_len == 4
        assert session.acceptance() == out.acceptance
        session.reset_stats()
        assert session.acceptance().rounds == 0
        sampled = session.speculative_generate(ids, 12, sampling=kvsieve.sparse.speculation.Sampling(top_k=20),
                                               generator=torch.Generator().manual_seed(0))
        again = session.speculative_generate(ids, 12, sampling=kvsieve.sparse.speculation.Sampling(top_k=20),
                                             generator=torch.Generator().manual_seed(0))
        assert torch.equal(sampled.tokens, again.tokens)  # seeded: reproducible
    with KvsieveSession(model, None) as dense, pytest.raises(ValueError, match="without speculate"):
        dense.speculative_generate(ids, 4)
    assert np.isfinite(out.acceptance.mean_accepted_length)


def test_lossless_page_examples_run_as_written() -> None:
    from pathlib import Path
    import re

    text = (Path(__file__).parents[2] / "docs" / "lossless.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "from vllm" not in b]  # vLLM's: tests/vllm
    assert len(blocks) == 2 and "speculate=4" in blocks[0]
    scope: dict = {}
    for code in blocks:
        exec(compile(code, "docs/lossless.md", "exec"), scope)  # noqa: S102
    assert scope["out"].tokens.shape == (1, 16) and scope["session"].acceptance().rounds > 0


def test_untied_mismatch_names_a_difference_where_dense_logits_are_not_tied() -> None:
    model = tiny_random_llama()
    ids = _prompt(60)
    ref = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert untied_mismatch(model, 60, ref, ref) is None
    wrong = ref.clone()
    wrong[0, 62] = (wrong[0, 62] + 1) % 256
    assert "row 0, position 62" in untied_mismatch(model, 60, ref, wrong)
    assert untied_mismatch(model, 60, ref, wrong, tol=1e9) is None  # any gap counts as a tie
    assert "tokens against" in untied_mismatch(model, 60, ref, ref[:, :-1])
