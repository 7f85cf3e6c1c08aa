"""The workloads of ``benchmarks/vllm_serve.py``: sessions of greedy completions, each session's turns
sent one after another (a turn's prompt holds the session's earlier questions and answers), the
sessions at once up to the concurrency.

* **shared document** (:func:`shared_document`): U users, each asking T questions about one document
  (the same text at the start of every prompt: vLLM's prefix cache holds it once computed);
* **independent prompts** (:func:`independent_prompts`): one long text and one question per session.

Questions quote a few words of a sentence of the text; answer lengths are drawn in a range with a
fixed seed, and every answer runs to its length (``ignore_eos``), so every mode generates the same
number of tokens.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

__all__ = ["Session", "shared_document", "independent_prompts", "quoted_questions"]

_SENTENCE = re.compile(r"[^.!?]+[.!?]")
QUOTE_WORDS = 6


@dataclass(frozen=True)
class Session:
    """One user's conversation: ``prefix`` (the text the questions are about, then the user's line),
    ``questions`` asked in order and the tokens each answer runs to (``answer_tokens``)."""

    name: str
    prefix: str
    questions: tuple[str, ...]
    answer_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.questions or len(self.questions) != len(self.answer_tokens):
            raise ValueError(f"session {self.name!r}: {len(self.questions)} questions and "
                             f"{len(self.answer_tokens)} answer lengths; expected as many of each, at least one")

    def prompt(self, answers: list[str]) -> str:
        """The prompt of turn ``len(answers)``: the prefix, each earlier turn's question and its
        ``answers`` entry, then this turn's question."""
        turn = len(answers)
        if turn >= len(self.questions):
            raise ValueError(f"session {self.name!r} has {len(self.questions)} turns; asked for turn {turn}")
        past = "".join(f"\n\nQuestion: {q}\nAnswer:{a}" for q, a in zip(self.questions, answers))
        return f"{self.prefix}{past}\n\nQuestion: {self.questions[turn]}\nAnswer:"


def quoted_questions(text: str, count: int, rng: random.Random) -> list[str]:
    """``count`` questions, each quoting the first :data:`QUOTE_WORDS` words of a sentence of ``text``
    drawn by ``rng`` (sentences shorter than that are skipped)."""
    sentences = [s.split()[:QUOTE_WORDS] for s in _SENTENCE.findall(text)]
    sentences = [s for s in sentences if len(s) == QUOTE_WORDS]
    if not sentences:
        raise ValueError(f"no sentence of {QUOTE_WORDS} words or more to ask about in the text")
    return [f'What does the text above say where it reads "{" ".join(rng.choice(sentences))}"?'
            for _ in range(count)]


def _lengths(answer_tokens: tuple[int, int], count: int, rng: random.Random) -> tuple[int, ...]:
    low, high = answer_tokens
    if not 1 <= low <= high:
        raise ValueError(f"answer tokens: expected 1 <= low <= high, got {low}..{high}")
    return tuple(rng.randint(low, high) for _ in range(count))


def shared_document(document: str, *, users: int, turns: int, answer_tokens: tuple[int, int], tag: str,
                    seed: int = 0) -> list[Session]:
    """``users`` sessions of ``turns`` questions about ``document``; each prefix is the document then
    a line naming the user and ``tag`` (so that two runs with different tags share the document in
    the prefix cache and nothing after it)."""
    if users < 1 or turns < 1:
        raise ValueError(f"shared document: users and turns must be >= 1, got {users} and {turns}")
    rng = random.Random(f"{seed}/{tag}")
    return [Session(f"u{u}", f"{document}\n\nReader {tag}.{u} asks about the text above.",
                    tuple(quoted_questions(document, turns, rng)), _lengths(answer_tokens, turns, rng))
            for u in range(users)]


def independent_prompts(texts: list[str], *, answer_tokens: tuple[int, int], tag: str,
                        seed: int = 0) -> list[Session]:
    """One session per text: the text, then one question about it."""
    if not texts:
        raise ValueError("independent prompts: no texts")
    rng = random.Random(f"{seed}/{tag}")
    return [Session(f"p{i}", text, tuple(quoted_questions(text, 1, rng)), _lengths(answer_tokens, 1, rng))
            for i, text in enumerate(texts)]
