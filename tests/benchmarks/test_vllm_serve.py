"""benchmarks/vllm_serve.py without vLLM: the percentiles and metrics against hand-worked values, the
workloads' prompts, the answer check (it fails on a difference) and the table (the servers
themselves: tests/vllm/test_serve_bench.py)."""
from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the benchmarks package lives at the repository root
    sys.path.insert(0, str(ROOT))

from benchmarks.vllm_client import Streamed  # noqa: E402
from benchmarks.vllm_serve import parse_args, report  # noqa: E402
from benchmarks.vllm_serve_report import (Cell, Record, check_answers, markdown_table, percentile, ratios,  # noqa: E402
                                          summarize)
from benchmarks.vllm_serve_workloads import (Session, independent_prompts, quoted_questions,  # noqa: E402
                                             shared_document)

DOC = "The harbour was cold that winter and quiet. Ships came in late with grain from the south coast. Short one."


def test_percentiles_are_linear_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]  # sorted 1 2 3 4: rank of q is 3q/100
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="q must be in 0..100"):
        percentile(values, 101)


def _rec(key: str, start: float, chunks: list[float], tokens: int, status: int = 200, message: str = "",
         prompt: int = 10) -> Record:
    return Record(key, start, Streamed(status, message, "x" * len(chunks), chunks, prompt, tokens,
                                       (chunks[-1] if chunks else 0.0) + 0.5))


def test_metrics_of_two_served_requests_and_a_refused_one():
    # a: sent at 0, chunks at 1, 2, 4 (3 tokens): TTFT 1, TPOT (4-1)/2 = 1.5, gaps 1 and 2; ends at 4.5
    # b: sent at 1, chunks at 0.5, 1.5 (2 tokens): TTFT 0.5, TPOT 1, gap 1; ends at 1 + 2 = 3
    records = [_rec("a/0", 0.0, [1.0, 2.0, 4.0], 3), _rec("b/0", 1.0, [0.5, 1.5], 2, prompt=12),
               _rec("c/0", 2.0, [], 0, status=400, message="too long", prompt=99)]
    m = summarize(records)
    assert (m.requests, m.served) == (3, 2)
    assert m.failed == ("c/0: HTTP 400 too long",) and m.prompt_tokens == (10, 12)
    assert m.ttft_ms["p50"] == pytest.approx(750.0) and m.ttft_ms["p99"] == pytest.approx(995.0)
    assert m.tpot_ms["p50"] == pytest.approx(1250.0)
    assert m.itl_ms["p50"] == pytest.approx(1000.0) and m.itl_ms["p90"] == pytest.approx(1800.0)
    assert m.duration_s == pytest.approx(4.5)  # from the first send (0) to the last end (a: 4.5)
    assert m.requests_per_s == pytest.approx(2 / 4.5) and m.output_tokens_per_s == pytest.approx(5 / 4.5)
    # a 200 whose answer the client cut (over its timeout) is not served
    assert not _rec("d/0", 0.0, [1.0], 1, message="the answer took more than 9 s").served


def test_ratios_and_table_compare_with_own_at_the_same_workload_and_concurrency():
    own = summarize([_rec("a/0", 0.0, [1.0, 2.0, 3.0], 3)])  # TTFT 1 s, TPOT 1 s, 3 tokens in 3.5 s
    fast = summarize([_rec("a/0", 0.0, [1.1, 1.6, 2.1], 3)])  # TTFT 1.1 s, TPOT 0.5 s, 3 tokens in 2.6 s
    cells = [Cell("shared", "own", 1, own), Cell("shared", "quest", 1, fast)]
    r = ratios(cells)[("shared", "quest", 1)]
    assert r["tpot_p50"] == pytest.approx(0.5) and r["ttft_p99"] == pytest.approx(1.1)
    assert r["output_tokens_per_s"] == pytest.approx(3.5 / 2.6)
    table = markdown_table(cells, "shared").splitlines()
    assert table[0].count("|") == table[1].count("|") == table[2].count("|") == 15
    assert table[3].startswith("| quest | 1 | 1/1 | 1100 | 1100 | 500.0 | 500.0 | 500.0 | 500.0 |")
    assert table[3].endswith("| 1.35 | 0.50 | 1.10 |")
    with pytest.raises(ValueError, match="no 'own' run of shared at concurrency 4"):
        ratios([Cell("shared", "quest", 4, fast)])
    refused = summarize([_rec("a/0", 0.0, [], 0, status=400, message="no")])
    text = report([Cell("shared", "own", 1, refused)], "CPU: x; load 1")
    assert "| own | 1 | 0/1 | - | - |" in text and "- own shared c=1 a/0: HTTP 400 no" in text


def test_the_answer_check_shows_a_difference_and_a_missing_answer():
    answers = {"own": {"k/0": "The grain came late.", "k/1": "x"}, "dense": {"k/0": "The grain came late.", "k/1": "x"},
               "quest": {"k/0": "The grain was late.", "k/1": "x"}, "lossy": {"k/0": "The grain came late."}}
    assert check_answers(answers, ["dense"]) == []
    assert check_answers(answers, ["quest"]) == ["quest k/0: differs from own at character 10: 'was late.' vs "
                                                 "'came late.'"]
    assert check_answers(answers, ["lossy"]) == ["lossy k/1: answered in own only"]


def test_a_session_prompt_holds_its_earlier_turns():
    s = Session("u0", "DOC", ("q1?", "q2?"), (3, 4))
    assert s.prompt([]) == "DOC\n\nQuestion: q1?\nAnswer:"
    assert s.prompt([" a1"]) == "DOC\n\nQuestion: q1?\nAnswer: a1\n\nQuestion: q2?\nAnswer:"
    with pytest.raises(ValueError, match="has 2 turns; asked for turn 2"):
        s.prompt(["a", "b"])
    with pytest.raises(ValueError, match="2 questions and 1 answer lengths"):
        Session("u0", "DOC", ("a", "b"), (3,))


def test_the_shared_workload_shares_the_document_and_nothing_after_it_across_tags():
    users = shared_document(DOC, users=3, turns=2, answer_tokens=(5, 9), tag="c4")
    assert [u.name for u in users] == ["u0", "u1", "u2"]
    assert all(u.prefix.startswith(DOC + "\n\nReader c4.") for u in users)
    assert len({u.prefix for u in users}) == 3
    assert all(5 <= n <= 9 for u in users for n in u.answer_tokens) and all(len(u.questions) == 2 for u in users)
    # the questions quote the six first words of a sentence of six words or more ("Short one." is not)
    assert {q for u in users for q in u.questions} <= {
        'What does the text above say where it reads "The harbour was cold that winter"?',
        'What does the text above say where it reads "Ships came in late with grain"?'}
    again = shared_document(DOC, users=3, turns=2, answer_tokens=(5, 9), tag="c4")
    assert again == users  # fixed seed: every mode gets the same workload
    other = shared_document(DOC, users=1, turns=1, answer_tokens=(5, 9), tag="c1")[0]
    assert other.prefix.startswith(DOC) and other.prefix != users[0].prefix
    with pytest.raises(ValueError, match="low <= high"):
        shared_document(DOC, users=1, turns=1, answer_tokens=(9, 5), tag="t")
    with pytest.raises(ValueError, match="users and turns must be >= 1"):
        shared_document(DOC, users=0, turns=1, answer_tokens=(5, 9), tag="t")
    with pytest.raises(ValueError, match="no sentence of 6 words"):
        quoted_questions("Too short. Also.", 1, random.Random(0))


def test_independent_prompts_one_question_each():
    sessions = independent_prompts([DOC, DOC.upper()], answer_tokens=(7, 7), tag="c1")
    assert [(s.name, s.prefix, s.answer_tokens) for s in sessions] == [("p0", DOC, (7,)), ("p1", DOC.upper(), (7,))]
    with pytest.raises(ValueError, match="no texts"):
        independent_prompts([], answer_tokens=(7, 7), tag="c1")


def test_the_command_line_runs_own_first_and_refuses_what_it_cannot_honour(capsys):
    args = parse_args(["--modes", "dense;quest:budget=384,page_size=16", "--concurrency", "1,4"])
    assert args.modes == ["own", "dense", "quest:budget=384,page_size=16"]
    assert args.exact == ["dense"] and args.concurrency == [1, 4] and args.workloads == ["shared", "independent"]
    assert parse_args(["--modes", "quest:budget=384"]).exact == []
    lossless = "quest:budget=384,page_size=16@4"  # the lossless mode must answer as own does
    assert parse_args(["--modes", f"quest:budget=384;{lossless}"]).exact == [lossless]
    for argv, message in ((["--modes", "own"], "a mode twice, or 'own'"), (["--exact", "dense"], "--exact: ['dense']"),
                          (["--workloads", "chat"], "unknown ['chat']"), (["--answer-tokens", "5"], "low,high")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err
