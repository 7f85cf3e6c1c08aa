"""RULER's offline task families (docs/eval.md, "RULER tasks"): each generator against what RULER
defines (checked by counting in the prompt), each scorer on hand-worked answers including a wrong
one that scores 0, and bad input refused at plan time by name (byte tokenizer: a token per byte)."""
from __future__ import annotations

import math
import re
from collections import Counter

import pytest

from kvsieve.eval.config import ConfigError, from_dict
from kvsieve.eval.haystack import essay_files
from kvsieve.eval.model import ByteTokenizer
from kvsieve.eval.tasks import get_task
from kvsieve.eval.tasks.continuation import matched_prefix
from kvsieve.eval.tasks.niah import ruler_niah_template

TOK = ByteTokenizer()
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
NEEDLE = re.compile(r"One of the special magic (numbers|uuids|words) for (\S+) is: (\S+)\.")
NIAH = {  # name: (haystack, keys asked, values per key, needles in total when not a needle haystack)
    "niah_single_1": ("noise", 1, 1, 1), "niah_single_2": ("essay", 1, 1, 1), "niah_single_3": ("essay", 1, 1, 1),
    "niah_multikey_1": ("essay", 1, 1, 4), "niah_multikey_2": ("needle", 1, 1, None),
    "niah_multikey_3": ("needle", 1, 1, None), "niah_multivalue": ("essay", 1, 4, 4),
    "niah_multiquery": ("essay", 4, 1, 4)}


def _one(name: str, length: int = 3000, depth: float = 50.0, seed: int = 0, **params):
    return get_task(name, params).make_samples(TOK, length, [depth], 1, seed=seed)[0]


def test_template_singular_when_one_value_is_asked():
    assert ruler_niah_template("numbers", single=True).format(context="C", query="k") == (
        "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you "
        "about the number afterwards.\nC\nWhat is the special magic number for k mentioned in the provided text? "
        "The special magic number for k mentioned in the provided text is")
    assert ruler_niah_template("uuids", single=False).format(context="C", query="k").startswith(
        "Some special magic uuids are hidden")


@pytest.mark.parametrize("name", sorted(NIAH))
def test_niah_generator(name):
    haystack, asked, per_key, total = NIAH[name]
    task = get_task(name)
    s = _one(name, depth=30.0)
    n = len(TOK.encode(s.prompt))
    assert 0.9 * 3000 <= n <= 3000, n
    needles = NEEDLE.findall(s.prompt)
    by_key: dict[str, list[str]] = {}
    for _, key, value in needles:
        by_key.setdefault(key, []).append(value)
    asked_keys = [k for k in by_key if k in s.meta["key"]]
    assert len(asked_keys) == asked and sorted(v for k in asked_keys for v in by_key[k]) == sorted(s.answers)
    assert all(len(by_key[k]) == per_key for k in asked_keys)
    if total is not None:
        assert len(needles) == total
    else:  # a haystack of distractor needles: many, none with a key asked
        assert len(needles) > 10 and "The grass is green" not in s.prompt
    assert ("The grass is green" in s.prompt) == (haystack == "noise")
    values = task.params["values"]
    for a in s.answers:
        assert (UUID.match(a) if values == "uuids" else re.fullmatch(r"\d{7}", a)), a
    if task.params["keys"] == "uuids":
        assert UUID.match(s.meta["key"])
    assert s.prompt.endswith("mentioned in the provided text " + ("is" if len(s.answers) == 1 else "are"))
    # the first value asked sits at the depth, snapped back to the start of its sentence or line (other
    # needles inserted before it move it later)
    frac = (s.meta["needle_char"] - s.meta["context_start"]) / s.meta["context_chars"]
    assert abs(frac - 0.30) <= 0.12, frac
    assert s.prompt[s.meta["needle_char"]:].startswith(f"One of the special magic {values} for")
    assert _one(name, depth=30.0).prompt == s.prompt and _one(name, depth=30.0, seed=1).prompt != s.prompt
    # scored: every value asked is 1; the values of keys not asked (distractors) are a wrong answer
    assert task.score(" " + ", ".join(s.answers) + ".", s) == 1.0
    distractors = [v for k, vs in by_key.items() if k not in asked_keys for v in vs]
    assert task.score(" " + ", ".join(distractors or ["0000000"]) + ".", s) == 0.0


def test_niah_value_and_haystack_options():
    s = _one("niah_single_2", values="uuids", haystack="noise")
    assert UUID.match(s.answers[0]) and "The grass is green" in s.prompt
    assert "special magic uuid for" in s.prompt


def test_niah_scores_hand_worked():
    single = get_task("niah_single_3")
    s = _one("niah_single_3")
    assert single.score(f" {s.answers[0].upper()}.", s) == 1.0  # RULER: case-insensitive substring
    assert single.score(" 4f1c2a3e-0000-4000-8000-000000000000.", s) == 0.0
    multi = get_task("niah_multivalue")
    m = _one("niah_multivalue")
    a, b, c, d = m.answers
    assert multi.score(f": {a}, {b}, {c} and {d}.", m) == 1.0
    assert multi.score(f": {d}, {b}.", m) == 0.5
    assert multi.score(": 1234567, 7654321.", m) == 0.0
    assert not multi.binary_score and single.binary_score and multi.max_new_tokens > single.max_new_tokens // 2


def test_vt_generator_and_score():
    task = get_task("variable_tracking")
    s = _one("variable_tracking", depth=10.0)
    assert 0.9 * 3000 <= len(TOK.encode(s.prompt)) <= 3000
    names = s.answers
    assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", x) for x in names)
    value = re.search(rf"^VAR {names[0]} = (\d{{5}})$", s.prompt, re.M).group(1)
    lines = s.prompt.split("\n")
    chain = [i for i, line in enumerate(lines) if re.match(rf"VAR ({'|'.join(names)}) =", line)]
    assert [lines[i] for i in chain] == [f"VAR {names[0]} = {value}"] + [
        f"VAR {b} = VAR {a} " for a, b in zip(names, names[1:])]  # RULER's lines, in chain order
    # the first assignment after int(depth% of the noise lines) of the task's context
    context = lines[lines.index("Memorize and track the chain(s) of variable assignment hidden in the following text.",
                                1) + 2: -1]
    noise = [line for line in context if line.startswith("The grass")]
    assert context.index(f"VAR {names[0]} = {value}") == int(len(noise) * 0.10)
    # the worked example first: 3-letter variables, its own value, its answer after the answer prefix
    example = re.findall(r"they are:  ([A-Z]{3}(?: [A-Z]{3}){4})\n", s.prompt)
    assert len(example) == 1 and s.prompt.count("Memorize and track") == 2
    assert s.prompt.endswith(f"5 variables are assigned the value {value}, they are: ")
    assert task.score(" ".join(names), s) == 1.0
    assert task.score(f"{names[0]} {names[3]}", s) == 0.4
    assert task.score(example[0], s) == 0.0  # the example's variables are a wrong answer


@pytest.mark.parametrize("length, repeats", [(2000, (6, 1)), (9000, (30, 3))])
def test_cwe_generator_and_score(length, repeats):
    task = get_task("cwe")
    s = _one("cwe", length=length)
    assert 0.9 * length <= len(TOK.encode(s.prompt)) <= length
    question = s.prompt.rindex("Below is a numbered list")
    listed = re.findall(r"\d+\. ([a-z]+)", s.prompt[question: s.prompt.rindex("\nQuestion:")])
    counts = Counter(listed)
    assert {counts[w] for w in s.answers} == {repeats[0]}
    assert set(counts.values()) == set(repeats) and len(counts) == 10 + s.meta["uncommon_words"]
    assert len(listed) == 10 * repeats[0] + s.meta["uncommon_words"] * repeats[1]
    assert s.prompt.count("Question: What are the 10 most common words") == 2  # the worked example and the task
    answer = " ".join(f"{i + 1}. {w}" for i, w in enumerate(s.answers))
    assert task.score(answer, s) == 1.0
    assert task.score(" ".join(s.answers[:3]), s) == pytest.approx(0.3)
    uncommon = [w for w, c in counts.items() if c == repeats[1]][:10]
    wrong = [w for w in uncommon if not any(w in a or a in w for a in s.answers)]
    assert wrong and task.score(" ".join(wrong), s) == 0.0


def test_fwe_generator_and_score():
    task = get_task("fwe")
    s = _one("fwe", length=4000)
    assert 0.9 * 4000 <= len(TOK.encode(s.prompt)) <= 4000
    text = s.prompt[s.prompt.index("coded words. ") + len("coded words. "): s.prompt.rindex("\nQuestion:")]
    counts = Counter(text.split())
    ranked = [w for w, _ in counts.most_common()]
    assert ranked[0] == "..." and ranked[1:4] == s.answers
    n = s.meta["coded_words"]
    zeta2 = math.pi ** 2 / 6
    for k, w in enumerate(ranked[:4], start=1):  # RULER: word k appears int(n k^-2 / zeta(2)) times
        assert counts[w] == int(n * k ** -2 / zeta2)
    assert len(counts) <= 4000 // 50 and all(re.fullmatch(r"[a-z]{6}", w) for w in ranked[1:])
    assert task.score(f" {', '.join(s.answers)}", s) == 1.0
    assert task.score(f" ..., {s.answers[1]}", s) == pytest.approx(1 / 3)
    assert task.score(" ..., " + ", ".join(ranked[5:8]), s) == 0.0


def test_continuation_generator_and_score():
    task = get_task("essay_continuation")
    s = _one("essay_continuation", length=2000)
    assert 0.9 * 2000 <= len(TOK.encode(s.prompt)) <= 1998 and s.depth is None and s.answers == []
    assert matched_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2 and matched_prefix([5], [6]) == 0
    ref = list(range(32))
    row = task.reference_row(ref[:30] + [0, 0], ref, TOK)
    assert row["matched_tokens"] == 30 and row["score"] == 30 / 32
    assert task.reference_row([7] + ref[1:], ref, TOK)["score"] == 0.0  # wrong from the first token
    dense = task.reference_row(ref, None, TOK)  # the dense run is its own reference
    assert dense["score"] == 1.0 and dense["_reference"] == ref
    with pytest.raises(ValueError, match="expected 32 tokens"):
        task.reference_row(ref[:5], ref, TOK)


def _cfg(tasks: dict) -> dict:
    return {"model": "tiny-random", "tasks": tasks, "selectors": {}}


@pytest.mark.parametrize("tasks, message", [
    ({"niah_single_3": {"lengths": [1024], "params": {"values": "uuid"}}},
     "tasks.niah_single_3.params: values: unknown values type 'uuid' of task 'niah_single_3'; valid: "
     "['numbers', 'words', 'uuids']"),
    ({"niah_single_1": {"lengths": [1024], "params": {"haystack": "books"}}},
     "tasks.niah_single_1.params: haystack: unknown haystack type 'books'"),
    ({"niah_single_1": {"lengths": [1024], "params": {"value": "uuids"}}},
     "tasks.niah_single_1.params: unknown option(s) ['value'] of task 'niah_single_1'; valid: "
     "['haystack', 'keys', 'values']"),
    ({"cwe": {"lengths": [1024], "params": {"values": "uuids"}}}, "tasks.cwe.params: unknown option(s) ['values']"),
    ({"cwe": {"lengths": [4096, 1_000_000]}}, "tasks.cwe.lengths: 1000000: the essay word list"),
    ({"niah_single_2": {"lengths": [10_000_000]}}, "tasks.niah_single_2.lengths: 10000000: the essays cannot "
                                                   "fill"),
    ({"essay_continuation": {"lengths": [10_000_000]}}, "tasks.essay_continuation.lengths: 10000000: the essays "
                                                        "cannot fill"),
])
def test_bad_task_input_refused_at_plan_time(tasks, message):
    with pytest.raises(ConfigError) as err:
        from_dict(_cfg(tasks))
    assert message in str(err.value)


def test_a_needle_haystack_fills_any_length():
    from_dict(_cfg({"niah_multikey_3": {"lengths": [10_000_000]}, "niah_single_1": {"lengths": [10_000_000]}}))


def test_essays_shorter_than_the_length_refused_when_made():
    """Past the plan-time bound (bytes), the tokenizer decides: fewer tokens than asked is an error."""
    length = sum(f.stat().st_size for f in essay_files())  # passes the plan check; whitespace is normalised
    task = get_task("niah_single_2")
    task.check_length(length)
    with pytest.raises(ValueError, match="fewer than the"):
        _one("niah_single_2", length=length)


def test_identity_carries_params_and_revision_only_when_set():
    """Runs of tasks without options or revisions keep their ids; variable tracking's new prompts
    (revision 1) and a run with options are new runs, never a reuse of the old folders."""
    from kvsieve.eval.run_plan import plan_runs, run_identity

    cfg = from_dict(_cfg({"passkey": {"lengths": [512]}, "variable_tracking": {"lengths": [1024]},
                          "niah_single_2": {"lengths": [1024], "params": {"values": "uuids"}}}))
    tasks = {c[0].task.name: run_identity(cfg, c[0])["task"] for c in plan_runs(cfg, "m")}
    assert tasks["passkey"] == {"name": "passkey", "depths": [50.0], "samples": 1, "length": 512}
    assert tasks["variable_tracking"]["revision"] == 1 and "params" not in tasks["variable_tracking"]
    assert tasks["niah_single_2"]["params"] == {"values": "uuids"} and "revision" not in tasks["niah_single_2"]
