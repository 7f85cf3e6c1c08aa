"""RULER's needle-in-a-haystack family ("One of the special magic numbers for {key} is: {value}.").

``niah_single`` and ``niah_multikey``: kvsieve's first two (Paul Graham essays, word keys, 7-digit
values, RULER's plural template whatever the number of answers; the distractors of
``niah_multikey`` at uniform random depths). The ``niah_*`` tasks named as in RULER's
``synthetic.yaml`` (:class:`RulerNiahTask`) follow RULER's definition: the haystack (``noise``
sentences, ``essay`` text, or ``needle``: a haystack made of distractor needles), the key and
value types (``words``, ``numbers``, ``uuids``), ``num_keys`` needles' keys (the distractors are the
keys not asked), ``num_values`` values per key, ``num_queries`` keys asked, and RULER's template in
the singular when one value is asked. Scored by RULER's string_match_all.
"""
from __future__ import annotations

import random
from typing import Any, ClassVar

from ..haystack import check_essay_length, essay_files, essay_haystack, insert_at_depths, noise_haystack
from ._prompt import fill_to_length, haystack_budget
from .base import Sample, Task, random_key, random_number, random_uuid, register_task

__all__ = ["NiahSingleTask", "NiahMultiKeyTask", "RulerNiahTask", "ruler_niah_template", "HAYSTACKS", "KINDS"]

_RULER = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
          "I will quiz you about the {kind} afterwards.\n{context}\n"
          "What are all the special magic {kind} for {query} mentioned in the provided text?"
          " The special magic {kind} for {query} mentioned in the provided text are")
HAYSTACKS = ("noise", "essay", "needle")
KINDS = ("numbers", "words", "uuids")
#: tokens of answer room per value asked (a uuid is 36 characters)
_TOKENS_PER_VALUE = {"numbers": 12, "words": 12, "uuids": 40}
_STOP = {"numbers": r"\d{7}\D", "uuids": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}[^0-9a-f]"}


def ruler_niah_template(kind: str, single: bool) -> str:
    """RULER's NIAH question around ``{context}`` about ``{query}``, ending with the answer prefix;
    in the singular (``A special magic number is ...``) when one value is asked, as RULER writes it."""
    if not single:
        return _RULER.replace("{kind}", kind)
    return _RULER.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("{kind}", kind[:-1])


_TEMPLATE = ruler_niah_template("numbers", single=False)


def _needle(key: str, value: str, kind: str = "numbers") -> str:
    return f"One of the special magic {kind} for {key} is: {value}."


def _draw(kind: str, rng: random.Random, used: set[str]) -> str:
    """A fresh key or value of ``kind``, not in ``used`` (then added to it)."""
    if kind == "words":
        return random_key(rng, used)
    while True:
        value = random_number(rng, 7) if kind == "numbers" else random_uuid(rng)
        if value not in used:
            used.add(value)
            return value


def _context_meta(head: int, context: str, offset: int) -> dict[str, Any]:
    return {"needle_char": offset + head, "context_start": head, "context_chars": len(context)}


class _Niah(Task):
    max_new_tokens = 16  # room for list-style answers (":\n1. 1234567")
    stop_regex = r"\d{7}\D"
    metric = "RULER string_match_all"
    binary_score = True  # one gold value per sample
    num_distractors = 0

    def make_one(self, tokenizer: Any, length: int, depth: float | None, rng: random.Random, index: int) -> Sample:
        used: set[str] = set()
        key, value = random_key(rng, used), random_number(rng, 7)
        needles = [_needle(key, value)]
        depths = [depth]
        for _ in range(self.num_distractors):
            needles.append(_needle(random_key(rng, used), random_number(rng, 7)))
            depths.append(rng.uniform(0, 100))
        fixed = _TEMPLATE.format(context="", query=key)
        hay = essay_haystack(tokenizer, haystack_budget(tokenizer, length, fixed, *needles), start=index + length)
        context, offsets = insert_at_depths(hay, needles, depths)
        head = _TEMPLATE.index("{context}")
        return Sample(index, _TEMPLATE.format(context=context, query=key), [value], depth,
                      {"key": key, **_context_meta(head, context, offsets[0])})


@register_task
class NiahSingleTask(_Niah):
    """One 7-digit magic number for a word key hidden in Paul Graham essays (RULER niah_single_2, plural template)."""

    name = "niah_single"


@register_task
class NiahMultiKeyTask(_Niah):
    """The needle among 3 distractor needles with other keys, in essays (RULER niah_multikey_1, plural template)."""

    name = "niah_multikey"
    num_distractors = 3


class RulerNiahTask(Task):
    """A RULER NIAH task (module docstring). The first value asked goes to the depth; every other
    needle to a uniform random depth."""

    metric = "RULER string_match_all"
    options: ClassVar[dict[str, Any]] = {"haystack": "essay", "keys": "words", "values": "numbers"}
    num_keys: ClassVar[int] = 1
    num_values: ClassVar[int] = 1
    num_queries: ClassVar[int] = 1

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        answers = self.num_queries * self.num_values
        values = self.params["values"]
        self.binary_score = answers == 1
        self.max_new_tokens = answers * _TOKENS_PER_VALUE[values] + 4
        self.stop_regex = _STOP.get(values) if answers == 1 else None

    def check_options(self) -> None:
        for option, valid in (("haystack", HAYSTACKS), ("keys", KINDS), ("values", KINDS)):
            if self.params[option] not in valid:
                raise ValueError(f"{option}: unknown {option} type {self.params[option]!r} of task {self.name!r}; "
                                 f"valid: {list(valid)}")

    def check_length(self, length: int) -> None:
        if self.params["haystack"] == "essay":
            check_essay_length(length)

    def make_one(self, tokenizer: Any, length: int, depth: float | None, rng: random.Random, index: int) -> Sample:
        p = self.params
        used: set[str] = set()
        keys = [_draw(p["keys"], rng, used) for _ in range(max(self.num_keys, self.num_queries))]
        values = [[_draw(p["values"], rng, used) for _ in range(self.num_values)] for _ in keys]
        asked = rng.sample(range(len(keys)), self.num_queries)
        answers = [v for i in asked for v in values[i]]
        needles = [_needle(keys[i], v, p["values"]) for i in asked for v in values[i]]
        needles += [_needle(k, v, p["values"]) for i, k in enumerate(keys) if i not in asked for v in values[i]]
        depths = [depth] + [rng.uniform(0, 100) for _ in needles[1:]]
        query = keys[asked[0]] if len(asked) == 1 else ", ".join(keys[i] for i in asked[:-1]) + \
            ", and " + keys[asked[-1]]
        template = ruler_niah_template(p["values"], single=len(answers) == 1)
        head = template.index("{context}")
        where = f"task {self.name}"
        if p["haystack"] == "needle":  # distractor needles of keys never asked, one per line
            distractors = [_needle(_draw(p["keys"], rng, set(keys)), _draw(p["values"], rng, set()), p["values"])
                           for _ in range(length // 4)]

            def context_of(n: int) -> str:
                return insert_at_depths("\n".join(distractors[:n]), needles, depths)[0]

            n = fill_to_length(tokenizer, length, lambda n: template.format(context=context_of(n), query=query),
                               len(distractors), where)
            context = context_of(n)
        else:
            budget = haystack_budget(tokenizer, length, template.format(context="", query=query), *needles)
            hay = (essay_haystack(tokenizer, budget, start=rng.randrange(len(essay_files())))
                   if p["haystack"] == "essay" else noise_haystack(tokenizer, budget))
            context = insert_at_depths(hay, needles, depths)[0]
        prompt = template.format(context=context, query=query)
        offset = context.index(needles[0])
        return Sample(index, prompt, answers, depth, {"key": query, **_context_meta(head, context, offset)})


def _ruler(name: str, doc: str, haystack: str, keys: str = "words", values: str = "numbers", num_keys: int = 1,
           num_values: int = 1, num_queries: int = 1) -> type[RulerNiahTask]:
    """Register RULER's task ``name`` (its ``synthetic.yaml`` entry) as a :class:`RulerNiahTask`."""
    cls = type(f"Niah_{name}", (RulerNiahTask,), {
        "name": name, "__doc__": doc, "num_keys": num_keys, "num_values": num_values, "num_queries": num_queries,
        "options": {"haystack": haystack, "keys": keys, "values": values}, "__module__": __name__})
    return register_task(cls)


_ruler("niah_single_1", "RULER niah_single_1: one word key's 7-digit number in noise sentences.", "noise")
_ruler("niah_single_2", "RULER niah_single_2: one word key's 7-digit number in essays.", "essay")
_ruler("niah_single_3", "RULER niah_single_3: one word key's UUID in essays.", "essay", values="uuids")
_ruler("niah_multikey_1", "RULER niah_multikey_1: one of 4 word keys asked, 3 distractor needles, essays.",
       "essay", num_keys=4)
_ruler("niah_multikey_2", "RULER niah_multikey_2: a haystack of distractor needles (word keys, numbers).",
       "needle")
_ruler("niah_multikey_3", "RULER niah_multikey_3: a haystack of distractor needles (UUID keys and values).",
       "needle", keys="uuids", values="uuids")
_ruler("niah_multivalue", "RULER niah_multivalue: 4 numbers for one word key, all asked, essays.", "essay",
       num_values=4)
_ruler("niah_multiquery", "RULER niah_multiquery: 4 word keys, all asked at once, essays.", "essay",
       num_queries=4)
