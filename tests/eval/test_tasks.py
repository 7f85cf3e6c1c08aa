"""Task generators: length, needle depth, determinism, gold answers present (byte tokenizer)."""
from __future__ import annotations

import pytest

from kvsieve.eval.haystack import insert_at_depths
from kvsieve.eval.model import ByteTokenizer
from kvsieve.eval.tasks import available_tasks, get_task

TOK = ByteTokenizer()
NEEDLE_TASKS = ["passkey", "niah_single", "niah_multikey", "variable_tracking"]


def test_registry():
    assert set(NEEDLE_TASKS + ["fidelity"]) <= set(available_tasks())
    with pytest.raises(ValueError, match="unknown task"):
        get_task("nope")


@pytest.mark.parametrize("name", NEEDLE_TASKS)
@pytest.mark.parametrize("depth", [0.0, 30.0, 90.0])
def test_needle_at_depth_and_length(name, depth):
    task = get_task(name)
    (s,) = task.make_samples(TOK, 3000, [depth], 1, seed=0)
    n = len(TOK.encode(s.prompt))
    assert 0.9 * 3000 <= n <= 3000
    assert s.depth == depth
    for a in s.answers:
        assert a in s.prompt
    frac = (s.meta["needle_char"] - s.meta["context_start"]) / s.meta["context_chars"]
    # snapped back to the preceding sentence end: never after the depth, at most a sentence before
    # (variable tracking: a line, and its 4 hops after it lengthen the context; test_ruler_tasks.py
    # checks its depth in noise lines)
    slack = 0.2 if name == "variable_tracking" else 0.06
    assert depth / 100 - slack <= frac <= depth / 100 + 1e-9, (frac, depth)


def test_deterministic_and_distinct():
    task = get_task("niah_single")
    a = task.make_samples(TOK, 1500, [50.0], 2, seed=7)
    b = task.make_samples(TOK, 1500, [50.0], 2, seed=7)
    c = task.make_samples(TOK, 1500, [50.0], 2, seed=8)
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert a[0].answers != a[1].answers
    assert [s.answers for s in a] != [s.answers for s in c]


def test_multikey_has_distractors_and_vt_chain():
    (s,) = get_task("niah_multikey").make_samples(TOK, 2000, [50.0], 1, seed=0)
    assert s.prompt.count("One of the special magic numbers for") == 4
    (v,) = get_task("variable_tracking").make_samples(TOK, 2000, [10.0], 1, seed=0)
    assert len(v.answers) == 5 and all(f"VAR {x} =" in v.prompt for x in v.answers)


def test_insert_at_depths_validates():
    text, offs = insert_at_depths("A. B. C. D. ", ["X."], [50])
    assert text[offs[0]:].startswith("X.")
    with pytest.raises(ValueError, match="depths"):
        insert_at_depths("A. B.", ["X."], [150])
    with pytest.raises(ValueError, match="same length"):
        insert_at_depths("A. B.", ["X.", "Y."], [10])


def test_fidelity_sample_has_no_depth():
    task = get_task("fidelity")
    (s,) = task.make_samples(TOK, 500, [10.0, 50.0], 1, seed=0)
    assert s.depth is None and task.prefix_len(500) == 500 - task.num_queries
