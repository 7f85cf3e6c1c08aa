"""The task contract: a task turns (tokenizer, length, depths, samples, seed) into prompts with
gold answers, and scores a prediction. Tasks register by name, like selectors."""
from __future__ import annotations

import random
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..metrics import digit_prefix_match, string_match_all

__all__ = ["Sample", "Task", "register_task", "get_task", "available_tasks", "WORDS", "random_key", "random_number",
           "random_uuid"]

_TASKS: dict[str, type[Task]] = {}


@dataclass
class Sample:
    """One prompt. ``answers``: every gold string; ``depth``: needle depth in percent (``None``
    when the task has none); ``meta``: anything a task wants in ``predictions.csv``."""

    index: int
    prompt: str
    answers: list[str]
    depth: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class Task:
    """Base class. ``kind``: ``"generate"`` (greedy answer, scored by :meth:`score`) or
    ``"fidelity"`` (per-layer attention metrics, see :mod:`kvsieve.eval.tasks.fidelity`).

    ``options``: the task's parameters and their defaults (a sweep sets them under
    ``tasks.<name>.params``); an instance is built with the defaults updated by the given values,
    each checked by :meth:`check_options` (an unknown key or value is a ``ValueError`` naming it)."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = "generate"
    # the answer's room, stop rule and interval may depend on a task's options: set per instance
    max_new_tokens: int = 12
    #: decoding stops once the answer so far matches this (``None``: always ``max_new_tokens``)
    stop_regex: str | None = None
    uses_depths: ClassVar[bool] = True
    #: raised whenever the task's prompts or scoring change, so a resume reruns the runs made before
    #: (part of each run's identity when nonzero)
    revision: ClassVar[int] = 0
    #: scores are 0 or 1 (their interval is Wilson's); otherwise a normal interval
    binary_score: bool = False
    #: what :meth:`score` measures, in words (the y-axis of the plots)
    metric: ClassVar[str] = "share of gold answers in the answer"
    #: the dense run's output on the same sample is the reference (:meth:`run`'s ``reference``): the
    #: dense run runs first on every sample, again (unrecorded) when it is already done
    needs_reference: ClassVar[bool] = False
    options: ClassVar[dict[str, Any]] = {}

    def __init__(self, **params: Any) -> None:
        unknown = sorted(set(params) - set(self.options))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} of task {self.name!r}; valid: {sorted(self.options)}")
        self.params = {**self.options, **params}
        self.check_options()

    def check_options(self) -> None:
        """Raise ``ValueError`` naming an option of ``self.params`` the task cannot honour."""

    def check_length(self, length: int) -> None:
        """Raise ``ValueError`` when a prompt of ``length`` tokens is certainly beyond what the task's
        haystack can fill, for any tokenizer (called when the sweep is planned, before a model
        loads; :meth:`make_one` checks again with the model's tokenizer)."""

    def make_samples(self, tokenizer: Any, length: int, depths: list[float], samples: int,
                     seed: int) -> list[Sample]:
        """``samples`` prompts per depth (or ``samples`` prompts when the task has no depth), each
        about ``length`` tokens; deterministic in ``seed``."""
        rng = random.Random(f"{self.name}/{length}/{seed}")
        out: list[Sample] = []
        for depth in (depths if self.uses_depths else [None]):
            for _ in range(samples):
                out.append(self.make_one(tokenizer, length, depth, rng, len(out)))
        return out

    def make_one(self, tokenizer: Any, length: int, depth: float | None, rng: random.Random, index: int) -> Sample:
        raise NotImplementedError

    def prefix_len(self, num_ids: int) -> int:
        """Prompt tokens prefilled before :meth:`run` (all of them for a generation task)."""
        return num_ids

    def run(self, session: Any, logits: Any, ids: Any, sample: Sample, reference: Any,
            tokenizer: Any) -> dict[str, Any]:
        """Continue the live request of ``session`` after the prefill (``logits [1, V]``) and
        return one row: ``prediction``, ``score`` and ``partial``."""
        stop = None if self.stop_regex is None else _regex_stop(self.stop_regex, tokenizer)
        new = session.continue_greedy(logits, self.max_new_tokens, getattr(tokenizer, "eos_token_id", None), stop)
        return self.answer_row(tokenizer.decode(new[0].tolist(), skip_special_tokens=True).strip(), sample)

    def answer_row(self, prediction: str, sample: Sample) -> dict[str, Any]:
        """The row of a generated answer (however it was generated): ``prediction``, ``score`` and
        ``partial`` (partial credit for numeric answers, never below the score)."""
        score = self.score(prediction, sample)
        # partial credit never below the score: a found answer is full credit however it is embedded
        digits = max(digit_prefix_match(prediction, a) if a.isdigit() else 0.0 for a in sample.answers)
        return {"prediction": prediction, "score": score, "partial": max(score, digits)}

    def score(self, prediction: str, sample: Sample) -> float:
        """Score in ``[0, 1]``; default: fraction of gold answers found in the prediction."""
        return string_match_all(prediction, sample.answers)


def _regex_stop(regex: str, tokenizer: Any) -> Any:
    """A ``stop(tokens [1, n])`` callback: true once the decoded answer matches ``regex``."""
    pattern = re.compile(regex)

    def stop(tokens: Any) -> bool:
        return pattern.search(tokenizer.decode(tokens[0].tolist(), skip_special_tokens=True)) is not None

    return stop


def register_task(cls: type[Task]) -> type[Task]:
    if not cls.name or cls.name in _TASKS:
        raise ValueError(f"task name must be non-empty and unique, got {cls.name!r}")
    _TASKS[cls.name] = cls
    return cls


def get_task(name: str, params: dict[str, Any] | None = None) -> Task:
    """The task ``name`` with its options ``params`` (defaults for the rest)."""
    if name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; available: {available_tasks()}")
    return _TASKS[name](**(params or {}))


def available_tasks() -> list[str]:
    return sorted(_TASKS)


# short, common words: each is a few tokens, so keys stay cheap and unambiguous
_ADJ = ("quiet bright heavy gentle rapid silver hollow ancient bitter brave calm clever curious eager fancy "
        "fierce golden humble jolly lively mighty noble proud rustic shiny tender vivid witty young zealous").split()
_NOUN = ("river falcon garden lantern meadow harbor violin pepper castle comet desert forest glacier island "
         "jacket kettle ladder marble needle orchard pencil quartz rocket saddle tiger tunnel wagon willow").split()
WORDS = (_ADJ, _NOUN)


def random_key(rng: random.Random, used: set[str] | None = None) -> str:
    """A RULER-style word key, ``adjective-noun``, not in ``used``."""
    while True:
        key = f"{rng.choice(_ADJ)}-{rng.choice(_NOUN)}"
        if used is None or key not in used:
            if used is not None:
                used.add(key)
            return key


def random_number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def random_uuid(rng: random.Random) -> str:
    """A version-4 UUID drawn from ``rng`` (RULER's uuid keys and values)."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))
