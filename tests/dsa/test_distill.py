"""``kvsieve distill-indexer`` on a tiny random Llama, in seconds: the KL falls, the file loads
into the ``dsa`` selector, and a KvsieveSession runs with the distilled indexer selecting."""
from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from kvsieve import SparseAttentionConfig
from kvsieve.eval.distill_indexer import main
from kvsieve.integrations.transformers import attach_dsa_indexer
from kvsieve.eval.model import ByteTokenizer, tiny_random_llama
from kvsieve.selectors.dsa.projections import load_projections


def test_distill_command_and_selector(tmp_path):
    out, js = tmp_path / "idx.pt", tmp_path / "r.json"
    assert main(["--model", "tiny-random", "--out", str(out), "--json", str(js), "--seq-len", "96",
                 "--num-seqs", "2", "--heldout-seqs", "1", "--rows", "48", "--epochs", "8", "--n-heads", "2",
                 "--head-dim", "16", "--rope-dim", "8", "--lr", "1e-2", "--grid", "1x8"]) == 0
    meta = json.loads(js.read_text())
    curve = meta["curve"]
    assert [c["epoch"] for c in curve] == list(range(9))
    assert curve[-1]["train_kl"] < curve[0]["train_kl"] and curve[-1]["heldout_kl"] < curve[0]["heldout_kl"]
    assert set(curve[-1]["recall"]) == {"4", "16", "64"} and all(0 < r <= 1 for r in curve[-1]["recall"].values())
    assert all(a["seconds"] <= b["seconds"] for a, b in zip(curve, curve[1:]))
    # the exact top-k of p keeps the most mass any set of that size can: at least the indexer's at every epoch
    # (up to the float sums' rounding). Streaming is no bound here: it keeps its 4 sinks even where k < 4.
    for d in ("4", "16", "64"):
        assert all(c["recall"][d] <= meta["oracle"][d] + 1e-6 for c in curve) and meta["oracle"][d] <= 1 + 1e-6
    assert not set(meta["split"]["train"]) & set(meta["split"]["held_out"])
    (small,) = meta["grid"]  # trained on the same captured windows: the untrained KL differs, the targets not
    assert (small["n_heads"], small["head_dim"], small["rope_dim"]) == (1, 8, 8)
    assert small["parameters"] < meta["parameters"] and len(small["curve"]) == 9
    assert small["curve"][0]["seconds"] > 0 and small["curve"][-1]["train_kl"] < small["curve"][0]["train_kl"]
    with pytest.raises(SystemExit):
        main(["--model", "tiny-random", "--out", str(out), "--grid", "4by16"])
    layers, saved = load_projections(str(out))
    assert sorted(layers) == [0, 1] and saved["n_heads"] == 2 and saved["layers"] == [0, 1]

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


def test_row_kl_and_recall_equal_plain_formulas_on_a_hand_case():
    """row_kl against a hand-written KL(p || softmax) and row_recall against counting by hand."""
    from kvsieve.selectors.dsa.distill import row_kl, row_recall

    p = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.5, 0.25, 0.25, 0.0], [0.1, 0.2, 0.3, 0.4]])
    logits = torch.tensor([[0.0, float("-inf"), float("-inf"), float("-inf")], [1.0, 2.0, 0.0, float("-inf")],
                           [0.5, -1.0, 2.0, 1.0]])
    want = []
    for pr, lr in zip(p.tolist(), logits.tolist()):
        z = sum(math.exp(x) for x in lr if x != float("-inf"))
        want.append(sum(a * math.log(a / (math.exp(x) / z)) for a, x in zip(pr, lr) if a > 0))
    assert float(row_kl(p, logits)) == pytest.approx(sum(want) / 3, rel=1e-6)
    rows = torch.tensor([0, 2, 3])
    # reduction factor 2: row 0 keeps 1 position (mass 1), row 2 keeps 2 (positions 1, 0: 0.75), row 3 keeps 2 (2, 3: 0.7)
    assert row_recall(p, logits, rows, 2) == pytest.approx((1.0 + 0.75 + 0.7) / 3)


def test_row_logits_equal_the_full_indexer_matrix():
    """The sampled-row logits are the rows of the full causal indexer matrix (q, k, w from forward)."""
    from kvsieve.selectors.dsa.distill import indexer_row_logits
    from kvsieve.selectors.dsa.projections import IndexerProjections

    torch.manual_seed(0)
    proj = IndexerProjections(24, 3, 8, 4)
    hidden, rows = torch.randn(40, 24), torch.tensor([0, 7, 20, 39])
    q, k, w = proj(hidden, torch.arange(40))
    full = torch.einsum("th,ths->ts", w, torch.einsum("thd,sd->ths", q, k).relu())
    full = full.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(indexer_row_logits(proj, hidden, rows), full[rows], rtol=1e-5, atol=1e-6)


def test_captured_targets_equal_the_models_eager_attention():
    """The captured targets' p rows equal transformers' eager attention weights, averaged over heads,
    and its hidden states the attention module's input."""
    from kvsieve.eval.attention_capture import capture_attention
    from kvsieve.selectors.dsa.distill_targets import window_targets

    model = tiny_random_llama()
    ids = torch.tensor([ByteTokenizer().encode("the quick brown fox jumps over the lazy dog, twice over")])
    rows = torch.tensor([3, 17, ids.shape[1] - 1])
    got = window_targets(capture_attention(model, ids, [0, 1], rows), rows)
    seen = {}
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, kw, out, i=i: seen.__setitem__(i, (kw, out)),
                                                   with_kwargs=True)
             for i, layer in enumerate(model.get_decoder().layers)]
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    for i in (0, 1):
        kw, out = seen[i]
        want = out[1][0].float().mean(0)[rows]  # [R, S]
        torch.testing.assert_close(got.p[i].float(), want, atol=2e-3, rtol=2e-3)  # fp16 storage
        torch.testing.assert_close(got.hidden[i].float(), kw["hidden_states"][0], atol=2e-2, rtol=1e-2)  # bf16


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm; glibc's malloc_trim")
def test_release_free_heap_gives_freed_heap_pages_back():
    """256 MB of 64 KB blocks (below glibc's mmap threshold: heap), every 16th kept so that the
    top of the heap stays in use and free() alone returns nothing; release_free_heap returns most
    of the 240 MB freed."""
    from kvsieve.eval.attention_capture import release_free_heap

    blocks = [bytearray(b"x" * (64 << 10)) for _ in range(4096)]
    keep = blocks[::16]
    blocks = None
    before = _resident_bytes()
    assert release_free_heap()
    assert before - _resident_bytes() > 150e6
    assert len(keep) == 256


def test_every_capture_releases_the_forward_passes_free_heap(monkeypatch):
    """Each capture hands its forward pass's freed heap back (docs/results/dsa.md, 8.1: 9.3 GB
    resident after 25 SmolLM2 2K captures without it): the distillation's (window_targets of a
    capture) and the mass-recall measurement's (capture_attention, kvsieve.eval.mass_recall) alike."""
    from kvsieve.eval import attention_capture
    from kvsieve.selectors.dsa.distill_targets import window_targets

    calls = []
    monkeypatch.setattr(attention_capture, "release_free_heap", lambda: calls.append(1) or True)
    ids = torch.tensor([ByteTokenizer().encode("a short window of text to capture")])
    model, rows = tiny_random_llama(), torch.tensor([5, ids.shape[1] - 1])
    window_targets(attention_capture.capture_attention(model, ids, [0, 1], rows), rows)
    assert calls == [1]
    attention_capture.capture_attention(model, ids, [0], rows)
    assert calls == [1, 1]


def test_sliding_layers_and_short_corpora_are_refused():
    from types import SimpleNamespace

    from kvsieve.selectors.common.text_windows import split_documents, token_windows
    from kvsieve.selectors.dsa.distill_config import DistillConfig
    from kvsieve.selectors.dsa.distill_targets import trainable_layers
    from kvsieve.sparse.calibration import Document

    cfg = SimpleNamespace(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2)
    assert trainable_layers(cfg, None) == [1, 3]
    with pytest.raises(ValueError, match=r"layers \[0\] are \['sliding_attention'\] layers"):
        trainable_layers(cfg, [0, 1])
    with pytest.raises(ValueError, match=r"DistillConfig.rows must be <= seq_len=64 \(rows are sampled from its positions\), got 80"):
        DistillConfig(seq_len=64, rows=80)
    for bad, field in (({"holdout_every": 0}, "holdout_every"), ({"rope_dim": 48}, "rope_dim"),
                       ({"rope_dim": 3}, "rope_dim"), ({"lr": float("nan")}, "lr"), ({"lr": 0.0}, "lr")):
        with pytest.raises(ValueError, match=f"DistillConfig.{field}( \\(.*\\))? must be"):
            DistillConfig(**bad)
    docs = [Document("essays", f"e{i}", "word " * 50) for i in range(4)] + [Document("pydoc", "t", "x y")]
    train, held = split_documents(docs)
    assert [d.name for d in held] == ["e0", "e2"] and [d.name for d in train] == ["e1", "e3", "t"]
    with pytest.raises(ValueError, match="token_windows: 1 documents give 3 tokens; 2 windows of 4 need 8"):
        token_windows(ByteTokenizer(), [Document("pydoc", "t", "x y")], 4, 2)


def test_windowed_attention_equals_masked_sdpa():
    from kvsieve.eval.attention_capture import windowed_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 37, 8), torch.randn(1, 2, 37, 8), torch.randn(1, 2, 37, 8)
    pos = torch.arange(37)
    mask = (pos[None] <= pos[:, None]) & (pos[None] > pos[:, None] - 6)
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            attn_mask=mask, scale=0.3)
    torch.testing.assert_close(windowed_attention(q, k, v, 6, 0.3), want.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_capture_on_a_sliding_window_model_keeps_its_logits_and_targets():
    """A tiny random Gemma 3 (sliding and full layers): the capture's forward gives the model's own
    logits (sliding layers through windowed_attention), and the full layer's targets equal eager."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from kvsieve.eval.attention_capture import capture_attention
    from kvsieve.selectors.dsa.distill_targets import trainable_layers, window_targets

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    model = Gemma3ForCausalLM(cfg).eval()
    ids = torch.randint(0, 300, (1, 40))
    rows = torch.tensor([5, 20, 39])
    assert trainable_layers(model.config, None) == [1]
    seen = {}
    hook = model.model.layers[1].self_attn.register_forward_hook(lambda m, a, out: seen.__setitem__("w", out[1]))
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want_logits = model(input_ids=ids, use_cache=False).logits[0, -1]
    hook.remove()
    got = window_targets(capture_attention(model, ids, [1], rows), rows)
    torch.testing.assert_close(got.p[1].float(), seen["w"][0].mean(0)[rows], atol=2e-3, rtol=2e-3)
    model.set_attn_implementation("kvsieve_distill_capture")  # registered by the capture, still in place
    with torch.no_grad():
        got_logits = model(input_ids=ids, use_cache=False).logits[0, -1]
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)


def test_collect_keeps_each_window_and_reuses_it_only_for_the_same_model_tokens_and_rows(tmp_path):
    """A rerun with ``captures`` reads the kept windows back instead of running the model; other rows
    (another seed) or other weights capture anew, and a capture read back equals one made without the cache."""
    import dataclasses

    from kvsieve.eval.model import load_model
    from kvsieve.eval.calibration import model_context
    from kvsieve.selectors.dsa import distill as di
    from kvsieve.selectors.dsa.distill_config import DistillConfig

    def same(a, b):
        return torch.equal(a.rows, b.rows) and all(torch.equal(a.p[i], b.p[i]) and torch.equal(a.hidden[i], b.hidden[i])
                                                   for i in a.p) and a.p.keys() == b.p.keys()

    def refuse(*args, **kwargs):
        raise AssertionError("captured again")

    lm = load_model("tiny-random")
    cfg = DistillConfig(seq_len=96, num_seqs=2, heldout_seqs=1, rows=16)
    ctx = model_context(lm)
    first = di.collect(ctx, cfg, progress=False, captures=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["held-96-0.pt", "train-96-0.pt", "train-96-1.pt"]
    plain = di.collect(ctx, cfg, progress=False)
    no_capture = dataclasses.replace(ctx, capture=refuse)
    again = di.collect(no_capture, cfg, progress=False, captures=tmp_path)
    with pytest.raises(AssertionError, match="captured again"):  # other rows: not reused
        di.collect(no_capture, dataclasses.replace(cfg, seed=1), progress=False, captures=tmp_path)
    with torch.no_grad():
        next(lm.model.parameters()).add_(1.0)
    with pytest.raises(AssertionError, match="captured again"):  # other weights: not reused
        di.collect(no_capture, cfg, progress=False, captures=tmp_path)
    assert all(same(a, b) and same(a, c) for a, b, c in zip(first.train + first.held, again.train + again.held,
                                                           plain.train + plain.held))
