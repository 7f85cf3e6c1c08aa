"""Retrieval windows for the indexer's distillation (``--retrieval-seqs``): the facts and their
questions are where the window says, they are not the eval's NIAH or passkey strings, every row of
the question/answer tail is sampled, and no held-out essay enters a training window."""
from __future__ import annotations

import random
import re

import pytest
import torch

from kvsieve.eval.model import ByteTokenizer
from kvsieve.eval.tasks.base import WORDS
from kvsieve.selectors.common.text_windows import split_documents
from kvsieve.selectors.dsa.distill_retrieval import CODE_WORDS, PEOPLE, PROJECTS, make_fact, retrieval_windows
from kvsieve.sparse.calibration import Document


def _essays(n: int, held_word: str = "", sentences: int = 60) -> list[Document]:
    """``n`` essays of numbered sentences; the held-out ones (every second, from the first) say ``held_word``."""
    return [Document("essays", f"e{i:02d}", " ".join(f"Essay {i} {held_word if i % 2 == 0 else 'trains'} "
                                                     f"sentence {j} is here." for j in range(sentences)))
            for i in range(n)]


def test_retrieval_windows_hold_each_fact_once_and_ask_each_once_at_the_end():
    tok = ByteTokenizer()
    docs = _essays(6)
    windows = retrieval_windows(tok, docs, 1200, 2, 3, seed=0)
    assert [w.facts for w in windows] == [w.facts for w in retrieval_windows(tok, docs, 1200, 2, 3, seed=0)]
    # the essays are read in reverse order, so the first window opens with the last essay
    stream = tok.encode(" ".join(d.text for d in docs[::-1]))
    for w in windows:
        ids = w.ids[0].tolist()
        assert w.ids.shape == (1, 1200) and w.ids.dtype == torch.int64
        for fact, (a, b) in zip(w.facts, w.fact_spans):
            assert tok.decode(ids[a:b]) == " " + fact and b <= w.tail_start
        tail = tok.decode(ids[w.tail_start:])
        lines = tail.split("\n")[1:]
        assert tail.startswith("\n") and len(lines) == 3 and sorted(w.asked) == [0, 1, 2]
        for line, i in zip(lines, w.asked):
            question, answer = line.split(" Answer: ")
            assert answer == w.facts[i]  # the answer restates the fact, teacher-forced
            key = re.search(r"project (\w+)\?|What is (\w+)'s", question).groups()
            assert any(k and k in w.facts[i] for k in key)
        # the rest of the window is the essays' text, in order, each fact at a sentence start
        rest = [t for j, t in enumerate(ids[: w.tail_start]) if not any(a <= j < b for a, b in w.fact_spans)]
        assert any(stream[k: k + len(rest)] == rest for k in range(len(stream))) and tok.decode(rest).endswith(".")
        for a, _ in w.fact_spans:
            assert a == 0 or tok.decode(ids[:a]).rstrip().endswith(".")


def test_retrieval_facts_are_not_the_eval_tasks_strings():
    """Other templates, question wording, key words and value lengths than RULER's NIAH (word keys
    from tasks.base.WORDS, 7-digit values) and passkey (5 digits)."""
    assert not {w.lower() for w in PROJECTS + PEOPLE + CODE_WORDS} & {w for group in WORDS for w in group}
    rng, facts = random.Random(0), []
    for _ in range(50):
        facts.append(make_fact(rng, set()))
    assert {f[0] == f[2] for f in facts} == {True}
    for fact, question, _ in facts:
        low = (fact + question).lower()
        assert "magic number" not in low and "pass key" not in low and "special" not in low
        assert all(len(n) == 4 for n in re.findall(r"\d+", fact))
    used: set[str] = set()
    keys = [make_fact(rng, used) for _ in range(len(PROJECTS) + len(PEOPLE))]
    assert len({k[0] for k in keys}) == len(keys)  # keys are distinct within a window


def test_too_many_facts_are_refused():
    with pytest.raises(ValueError, match="retrieval windows: 8 facts and their questions take .* of the window's 399"):
        retrieval_windows(ByteTokenizer(), _essays(6), 399, 1, 8, seed=0)
    with pytest.raises(ValueError, match="facts must be >= 1"):
        retrieval_windows(ByteTokenizer(), _essays(6), 800, 1, 0, seed=0)
    with pytest.raises(ValueError, match=r"token_windows: 1 documents give \d+ tokens; 1 windows of 5000 need 5000"):
        retrieval_windows(ByteTokenizer(), _essays(1), 5000, 3, 1, seed=0)  # no pass of the essays fills a window
    with pytest.raises(ValueError, match="no essays"):
        retrieval_windows(ByteTokenizer(), [Document("pydoc", "t", "x. " * 500)], 800, 1, 1, seed=0)


def test_sample_rows_with_a_tail_keeps_every_tail_row_and_the_former_draw_without_one():
    from kvsieve.selectors.dsa.distill_targets import sample_rows

    rows = sample_rows(400, 100, torch.Generator().manual_seed(3), tail=60)
    assert rows.tolist() == sorted(set(rows.tolist())) and len(rows) == 100
    assert set(range(340, 400)) <= set(rows.tolist()) and rows.min() >= 400 // 8
    # without a tail, the draw is the one of earlier versions (so their kept captures stay valid)
    gen = torch.Generator().manual_seed(5)
    old = torch.randperm(400 - 1 - 50, generator=gen)[:99] + 50
    want = torch.cat([old, torch.tensor([399])]).sort().values
    assert torch.equal(sample_rows(400, 100, torch.Generator().manual_seed(5)), want)
    with pytest.raises(ValueError, match="last 120 rows must all be sampled, but only 100"):
        sample_rows(400, 100, gen, tail=120)
    with pytest.raises(ValueError, match="tail must be >= 1"):
        sample_rows(400, 100, gen, tail=0)


def test_collect_samples_the_tail_rows_and_never_trains_on_held_out_essays():
    """With a tiny model: the retrieval windows' sampled rows hold every tail row (the tail found
    independently, by rebuilding the windows), and no window the model is trained on holds text of
    a held-out essay, while the held-out windows do."""
    import dataclasses

    from kvsieve.eval.model import load_model
    from kvsieve.eval.calibration import model_context
    from kvsieve.selectors.dsa.distill import collect
    from kvsieve.selectors.dsa.distill_config import DistillConfig

    # short essays: each window spans several of them, so a held-out one would be caught
    docs = _essays(8, held_word="HELDOUT", sentences=15) + [Document("pydoc", "t", "Python text is here. " * 80)]
    seen: list[torch.Tensor] = []
    base = model_context(load_model("tiny-random"))
    ctx = dataclasses.replace(base, documents=lambda: docs,
                              capture=lambda ids, *a: seen.append(ids) or base.capture(ids, *a))
    cfg = DistillConfig(seq_len=900, num_seqs=2, heldout_seqs=1, rows=400, retrieval_seqs=2, retrieval_facts=2)
    corpus = collect(ctx, cfg, progress=False)
    assert len(corpus.train) == 4 and len(corpus.held) == 1 and len(seen) == 5
    texts = [ByteTokenizer().decode(ids[0].tolist()) for ids in seen]  # train, train, held, retrieval, retrieval
    assert ["HELDOUT" in t for t in texts] == [False, False, True, False, False]
    train_docs, _ = split_documents(docs)
    for w, got, ids in zip(retrieval_windows(ByteTokenizer(), train_docs, 900, 2, 2, cfg.seed), corpus.train[2:], seen[3:]):
        assert torch.equal(w.ids, ids)
        assert set(range(w.tail_start, 900)) <= set(got.rows.tolist()) and len(got.rows) == 400
        assert 900 - w.tail_start < 400  # prose rows were drawn besides the tail


def test_more_windows_than_one_pass_take_the_essays_in_other_orders():
    """Past the windows one pass of the essays holds, further passes cut the same (training) essays
    in other seeded orders: the first pass is the windows a smaller count gets, every window's
    essay text is a run of one order's stream, and the later passes' windows are new text runs."""
    tok, docs = ByteTokenizer(), _essays(8, sentences=15)  # a window spans several essays
    per_pass = len(" ".join(d.text for d in docs)) // 1200  # bytes, no special prefix
    assert per_pass >= 2
    few = retrieval_windows(tok, docs, 1200, per_pass, 3, seed=0)
    many = retrieval_windows(tok, docs, 1200, 2 * per_pass + 1, 3, seed=0)
    assert len(many) == 2 * per_pass + 1
    assert all(torch.equal(a.ids, b.ids) and a.facts == b.facts for a, b in zip(few, many))
    again = retrieval_windows(tok, docs, 1200, 2 * per_pass + 1, 3, seed=0)
    assert all(torch.equal(a.ids, b.ids) for a, b in zip(many, again))  # deterministic in the seed
    stream = " ".join(d.text for d in docs[::-1])
    rests = []
    for w in many:
        ids = w.ids[0].tolist()
        rest = [t for j, t in enumerate(ids[: w.tail_start]) if not any(a <= j < b for a, b in w.fact_spans)]
        rests.append(tok.decode(rest))
    assert all(r in stream for r in rests[:per_pass])
    assert not all(r in stream for r in rests[per_pass:])  # other neighbours: not runs of the first order
    for r in rests[per_pass:]:  # yet only the given essays' sentences
        assert set(re.findall(r"Essay (\d+) ", r)) <= {str(i) for i in range(8)}
    assert len(set(rests)) == len(rests)
