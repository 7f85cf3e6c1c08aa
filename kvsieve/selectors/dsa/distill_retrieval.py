"""Retrieval windows for distilling the DSA indexer: training rows where attention retrieves.

Prose rows rarely ask a later token to find one earlier fact, so an indexer distilled on them
ranks where running prose attends, not the content match a question needs (docs/results/dsa.md,
section 6.3). A retrieval window is a window of *training* essays (the held-out essays never enter
one) with ``facts`` short synthetic facts inserted at random sentence ends and, at the end, a
question about each fact followed by its answer (teacher-forced, so the model's attention at
the answer rows reads the fact):

    ... essay text. The code name of project Quasar is cobalt-4821. More essay text ...
    Question: What is the code name of project Quasar? Answer: The code name of project Quasar is cobalt-4821.

These are deliberately *not* the eval's tasks: RULER's NIAH (:mod:`kvsieve.eval.tasks.niah`) hides "One of the
special magic numbers for <adjective-noun> is: <7 digits>." and asks "What are all the special
magic numbers for ...", and passkey (:mod:`kvsieve.eval.tasks.passkey`) hides a 5-digit "pass key" in noise.
Here the templates, the question wording, the key vocabulary (:data:`PROJECTS`, :data:`PEOPLE`,
:data:`CODE_WORDS`, none of them among the NIAH key words) and the values (``word-4 digits`` or 4
digits) all differ; what the indexer can learn from them is the skill (a question's answer rows
attend to the one earlier sentence that holds its key), not the eval's strings.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from ...sparse.calibration import Document
from ..common.text_windows import special_prefix, token_windows

__all__ = ["RetrievalWindow", "retrieval_windows", "make_fact", "PROJECTS", "PEOPLE", "CODE_WORDS"]

PROJECTS = ("Aurora Basilisk Cinder Dynamo Ember Fjord Gryphon Helix Icarus Juniper Kestrel Lotus Monsoon Nimbus "
            "Obsidian Phoenix Quasar Raven Sequoia Tundra Umbra Vortex Wren Zephyr").split()
PEOPLE = ("Alice Bruno Chiara Dmitri Elena Farid Greta Hiroshi Ingrid Jamal Keiko Lars Mei Nadia Omar Priya Quentin "
          "Rosa Sven Tariq Ursula Viktor Yara Zoltan").split()
CODE_WORDS = "amber cobalt crimson indigo jade maroon ochre scarlet teal umber azure coral ivory onyx sable".split()
_SENTENCE_END = (".", "!", "?")


def make_fact(rng: random.Random, used: set[str]) -> tuple[str, str, str]:
    """One fact with a key not in ``used`` (added to it): ``(fact, question, answer)``, the answer
    restating the key before the value, e.g. ``("Rosa's locker number is 5307.", "What is Rosa's
    locker number?", "Rosa's locker number is 5307.")``."""
    while True:
        if rng.random() < 0.5:
            key = rng.choice(PROJECTS)
            value = f"{rng.choice(CODE_WORDS)}-{rng.randrange(1000, 10000)}"
            fact, question = f"The code name of project {key} is {value}.", f"What is the code name of project {key}?"
        else:
            key = rng.choice(PEOPLE)
            value = str(rng.randrange(1000, 10000))
            fact, question = f"{key}'s locker number is {value}.", f"What is {key}'s locker number?"
        if key not in used:
            used.add(key)
            return fact, question, fact


@dataclass(frozen=True)
class RetrievalWindow:
    """One retrieval window: ``ids [1, S]`` (int64, starting with the tokenizer's special prefix),
    ``tail_start`` (the first position of the question/answer tail, which runs to ``S - 1``), the
    inserted ``facts`` in window order with their token ``fact_spans`` (``[start, end)``), and
    ``asked``: the fact asked by each question of the tail, in tail order (indices into ``facts``)."""

    ids: torch.Tensor
    tail_start: int
    facts: list[str]
    fact_spans: list[tuple[int, int]]
    asked: list[int]


def _build(tokenizer: Any, prefix: list[int], body: list[int], facts: int, rng: random.Random) -> RetrievalWindow:
    used: set[str] = set()
    made = [make_fact(rng, used) for _ in range(facts)]
    order = list(range(facts))
    rng.shuffle(order)  # the questions come in another order than the facts
    tail = tokenizer.encode("\n" + "\n".join(f"Question: {made[i][1]} Answer: {made[i][2]}" for i in order),
                            add_special_tokens=False)
    fact_ids = [tokenizer.encode(" " + f[0], add_special_tokens=False) for f in made]
    size = len(body) - len(tail) - sum(map(len, fact_ids))
    if size < len(body) // 2:
        raise ValueError(f"retrieval windows: {facts} facts and their questions take {len(body) - size} of the "
                         f"window's {len(body)} tokens; use fewer facts or a longer seq_len")
    enders = {t for t in set(body) if tokenizer.decode([t]).rstrip().endswith(_SENTENCE_END)}
    ends = [j + 1 for j, t in enumerate(body) if t in enders and j + 1 >= size]
    end = ends[-1] if ends else size  # the essay text before the tail ends at a sentence end
    hay = body[end - size: end]
    starts = [0] + [j + 1 for j, t in enumerate(hay) if t in enders]
    # each fact goes to the sentence start nearest below a uniform random depth; ties keep fact order
    depths = [rng.random() * len(hay) for _ in range(facts)]
    cuts = sorted((max(s for s in starts if s <= d), i) for i, d in enumerate(depths))
    ids, spans, prev = list(prefix), [(0, 0)] * facts, 0
    for cut, i in cuts:
        ids += hay[prev:cut]
        spans[i] = (len(ids), len(ids) + len(fact_ids[i]))
        ids += fact_ids[i]
        prev = cut
    ids += hay[prev:]
    tail_start = len(ids)
    ids += tail
    return RetrievalWindow(torch.tensor(ids).unsqueeze(0), tail_start, [f[0] for f in made], spans, order)


def retrieval_windows(tokenizer: Any, docs: list[Document], seq_len: int, count: int, facts: int,
                      seed: int) -> list[RetrievalWindow]:
    """``count`` retrieval windows of exactly ``seq_len`` tokens (module docstring) cut from the
    essays among ``docs`` (pass the training documents only). The first pass takes the essays in
    reverse order, so that its windows start elsewhere than the prose windows of the same essays;
    when ``count`` needs more windows than one pass holds, each further pass takes the same essays
    in another seeded order, so the text recurs with other neighbours, other facts and other depths
    (a fact's window and depth are drawn per window). The first pass's windows do not depend on
    ``count``. Deterministic in ``seed``. Refuses when the essays do not fill one window or the
    facts leave less than half of a window to the essay text."""
    if facts < 1:
        raise ValueError(f"retrieval_windows: facts must be >= 1, got {facts}")
    essays = [d for d in docs if d.source == "essays"][::-1]
    if not essays:
        raise ValueError("retrieval_windows: the documents hold no essays to insert facts into")
    prefix = special_prefix(tokenizer)
    out: list[RetrievalWindow] = []
    order, passes = essays, 0
    while len(out) < count:
        # every whole window of this order (token_windows refuses essays that fill none)
        for window in token_windows(tokenizer, order, seq_len, None)[: count - len(out)]:
            body = window[0, len(prefix):].tolist()
            out.append(_build(tokenizer, prefix, body, facts, random.Random(f"distill-retrieval/{seed}/{len(out)}")))
        passes += 1
        order = list(essays)
        random.Random(f"distill-retrieval/{seed}/order/{passes}").shuffle(order)
    return out
