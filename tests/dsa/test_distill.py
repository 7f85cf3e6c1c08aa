"""``kvsieve distill-indexer`` on a tiny random Llama, in seconds: the KL falls, the file loads
into the ``dsa`` selector, and a KvsieveSession runs with the distilled indexer selecting."""
from __future__ import annotations

import json

import pytest
import torch

from kvsieve import SparseAttentionConfig
from kvsieve.eval.distill_indexer import attach_dsa_indexer, main
from kvsieve.eval.model import ByteTokenizer, tiny_random_llama
from kvsieve.selectors.dsa.projections import load_projections


def test_distill_command_and_selector(tmp_path):
    out, js = tmp_path / "idx.pt", tmp_path / "r.json"
    assert main(["--model", "tiny-random", "--out", str(out), "--json", str(js), "--seq-len", "96",
                 "--num-seqs", "2", "--epochs", "8", "--n-heads", "2", "--head-dim", "16", "--rope-dim", "8",
                 "--eval-len", "160", "--topks", "16,32", "--lr", "1e-2"]) == 0
    meta = json.loads(js.read_text())
    assert meta["kl_history"][-1] < meta["kl_history"][0]
    assert set(meta["recall"]["indexer"]) == {"16", "32"}
    layers, saved = load_projections(str(out))
    assert sorted(layers) == [0, 1] and saved["n_heads"] == 2

    from kvsieve.integrations.transformers import KvsieveSession

    model = tiny_random_llama()
    cfg = SparseAttentionConfig("dsa", dict(projections=str(out), n_heads=2, head_dim=16, rope_dim=8, index_topk=16))
    session = KvsieveSession(model, cfg, max_tokens=128)
    attach_dsa_indexer(session)
    ids = torch.tensor([ByteTokenizer().encode("the quick brown fox jumps over the lazy dog " * 2)])
    new = session.generate(ids, max_new_tokens=3)
    assert new.shape == (1, 3)
    frac = session.attended_fraction("generation")
    assert all(f is not None and f < 1.0 for f in frac)
    assert session.layers[0].plan.selector.stats.indexed_steps > 0


def test_session_hands_indexer_inputs_down_with_each_forward_only():
    """The pre-hook's IndexerInputs reach the layer through the attention call; once the hooks are
    removed the next forward is refused by name (nothing was kept from the previous one)."""
    from kvsieve.integrations.transformers import KvsieveSession
    from kvsieve.selectors.dsa.projections import IndexerProjections

    model = tiny_random_llama()
    cfg = SparseAttentionConfig("dsa", dict(n_heads=2, head_dim=16, rope_dim=8, index_topk=8))
    session = KvsieveSession(model, cfg, max_tokens=128)
    torch.manual_seed(0)
    session.layers[0].plan.selector.set_projections({i: IndexerProjections(64, 2, 16, 8) for i in range(2)})
    handles = attach_dsa_indexer(session)
    ids = torch.tensor([ByteTokenizer().encode("the quick brown fox jumps over the lazy dog")])
    session.generate(ids, max_new_tokens=2)
    assert session.layers[0].plan.selector.stats.indexed_steps > 0
    for h in handles:
        h.remove()
    before = (session.cache.valid_len(0), session.num_cached_positions)
    with pytest.raises(ValueError, match="layer 0: selector 'dsa' needs this step's IndexerInputs.*got none"):
        session.decode(torch.tensor([65]))
    assert (session.cache.valid_len(0), session.num_cached_positions) == before  # the refused step was undone
    attach_dsa_indexer(session)
    session.decode(torch.tensor([65]))  # and the session goes on from where it was
    assert (session.cache.valid_len(0), session.num_cached_positions) == (before[0] + 1, before[1] + 1)


def test_transformers_driven_refusal_leaves_no_step_open():
    """``model.generate`` (transformers' own cache) with the hooks removed is refused at layer 0 and
    the step it opened is undone, so the next ``generate`` starts cleanly."""
    from kvsieve.integrations.transformers import KvsieveSession
    from kvsieve.selectors.dsa.projections import IndexerProjections

    model = tiny_random_llama()
    cfg = SparseAttentionConfig("dsa", dict(n_heads=2, head_dim=16, rope_dim=8, index_topk=8))
    session = KvsieveSession(model, cfg, max_tokens=128)
    torch.manual_seed(0)
    session.layers[0].plan.selector.set_projections({i: IndexerProjections(64, 2, 16, 8) for i in range(2)})
    ids = torch.tensor([ByteTokenizer().encode("the quick brown fox jumps over the lazy dog")])
    with pytest.raises(ValueError, match="layer 0: selector 'dsa' needs this step's IndexerInputs"):
        model.generate(ids, max_new_tokens=2, do_sample=False)
    assert session.cache.request_ids == []  # the failed prefill left no request behind
    attach_dsa_indexer(session)
    out = model.generate(ids, max_new_tokens=2, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 2) and session.layers[0].plan.selector.stats.indexed_steps > 0
