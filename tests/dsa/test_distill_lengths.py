"""``kvsieve distill-indexer --seq-len A B ...``: one indexer distilled on windows of several
lengths (SmolLM2 at tiny lengths, in seconds), its held-out recall reported per length, and the
refusals of lengths the corpus cannot fill, by name and before any capture."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvsieve.eval.calibration import model_context
from kvsieve.eval.distill_indexer import main
from kvsieve.eval.model import load_model
from kvsieve.selectors.dsa import distill as di
from kvsieve.selectors.dsa.distill_config import DistillConfig
from kvsieve.selectors.dsa.projections import load_projections

TINY = ["--num-seqs", "2", "--heldout-seqs", "1", "--rows", "32", "--epochs", "3", "--n-heads", "2",
        "--head-dim", "16", "--rope-dim", "8", "--lr", "1e-2", "--layers", "3", "7"]


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2")


def test_one_indexer_on_several_lengths_reports_held_out_recall_per_length(tmp_path, capsys, smollm2):
    out, js = tmp_path / "idx.pt", tmp_path / "r.json"
    assert main(["--model", "smollm2", "--out", str(out), "--json", str(js), "--seq-len", "64", "160"] + TINY) == 0
    meta = json.loads(js.read_text())
    assert meta["seq_len"] == [64, 160] and meta["layers"] == [3, 7]
    curve = meta["curve"]
    assert curve[-1]["train_kl"] < curve[0]["train_kl"] and curve[-1]["heldout_kl"] < curve[0]["heldout_kl"]
    for c in curve:
        by_length = c["recall_by_length"]
        assert set(by_length) == {"64", "160"} and all(set(r) == {"4", "16", "64"} for r in by_length.values())
        # the overall recall is the mean of the lengths' (one held-out window per length)
        assert all(c["recall"][d] == pytest.approx((by_length["64"][d] + by_length["160"][d]) / 2) for d in c["recall"])
    for n in ("64", "160"):  # the exact top-k of p bounds the indexer's recall at each length
        oracle = meta["oracle_by_length"][n]
        assert all(c["recall_by_length"][n][d] <= oracle[d] + 1e-6 for c in curve for d in oracle)
    printed = capsys.readouterr().out
    for n in (64, 160):
        assert f"indexer held-out recall at {n}: 1/4 " in printed
        assert f"oracle (exact top-k of p) held-out recall at {n}: 1/4 " in printed
    layers, saved = load_projections(str(out))
    assert sorted(layers) == [3, 7] and tuple(saved["seq_len"]) == (64, 160)

    # the windows: num_seqs training and heldout_seqs held-out windows at each length, in the order given
    cfg = DistillConfig(seq_len=(160, 64), num_seqs=2, heldout_seqs=1, rows=32)
    corpus = di.collect(model_context(smollm2, layers=[3]), cfg, progress=False)
    assert [w.seq_len for w in corpus.train] == [160, 160, 64, 64] and [w.seq_len for w in corpus.held] == [160, 64]
    assert all(w.hidden[3].shape[0] == w.seq_len and w.rows.numel() == 32 for w in corpus.train + corpus.held)
    # one length given as a tuple of one is the single-length form
    one = di.collect(model_context(smollm2, layers=[3]), dataclasses.replace(cfg, seq_len=(64,)), progress=False)
    single = di.collect(model_context(smollm2, layers=[3]), dataclasses.replace(cfg, seq_len=64), progress=False)
    assert all(torch.equal(a.rows, b.rows) and torch.equal(a.p[3], b.p[3]) for a, b in zip(one.train, single.train))


@pytest.mark.parametrize("change,message", [
    ({"seq_len": (64, 10**8)}, r"distill: the training windows at seq_len 100000000: token_windows: .* 2 windows "
                               r"of 100000000 need"),
    ({"heldout_seqs": 10**5}, r"distill: the held-out windows at seq_len 64: token_windows: .* 100000 windows of 64"),
    ({"seq_len": (256, 64), "retrieval_seqs": 1, "retrieval_facts": 1},
     r"distill: the retrieval windows at seq_len 64: retrieval windows: 1 facts and their questions take \d+ of the "
     r"window's 64 tokens"),
])
def test_a_length_the_corpus_cannot_fill_is_refused_by_name_before_any_capture(smollm2, change, message):
    captured = []
    ctx = dataclasses.replace(model_context(smollm2, layers=[3]), capture=lambda *a: captured.append(a))
    cfg = dataclasses.replace(DistillConfig(seq_len=64, num_seqs=2, heldout_seqs=1, rows=32), **change)
    with pytest.raises(ValueError, match=message):
        di.collect(ctx, cfg, progress=False)
    assert captured == []


@pytest.mark.parametrize("seq_len,message", [
    ((), r"DistillConfig.seq_len must be an int >= 1 or a non-empty tuple of distinct ints >= 1, got \(\)"),
    ((64, 64), r"DistillConfig.seq_len must be .* distinct ints >= 1, got \(64, 64\)"),
    ((64, 0), r"DistillConfig.seq_len must be .*, got \(64, 0\)"),
    ((64, "128"), r"DistillConfig.seq_len \(.*\) must be an int or a tuple of ints"),
    ((256, 16), r"DistillConfig.rows must be <= seq_len=16"),
])
def test_bad_lengths_are_refused_by_name(seq_len, message):
    with pytest.raises(ValueError, match=message):
        DistillConfig(seq_len=seq_len, rows=32)


def test_the_command_refuses_bad_lengths_before_loading_the_model(monkeypatch, tmp_path):
    import kvsieve.eval.model as model

    monkeypatch.setattr(model, "load_model", lambda *a: pytest.fail("the model was loaded"))
    with pytest.raises(ValueError, match=r"DistillConfig.seq_len must be .* got \(64, 64\)"):
        main(["--model", "smollm2", "--out", str(tmp_path / "x.pt"), "--seq-len", "64", "64"])
    assert not (tmp_path / "x.pt").exists()


def test_a_list_of_lengths_is_taken_as_a_tuple():
    """YAML and JSON (``calibrate_params``) give several lengths as a list."""
    cfg = DistillConfig(seq_len=[128, 64], rows=32)
    assert cfg.seq_len == (128, 64) and cfg.lengths == (128, 64) and DistillConfig(seq_len=96, rows=32).lengths == (96,)
