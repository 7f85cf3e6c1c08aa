"""Answers generated outside kvsieve's session, and the per-prompt agreement of two sweeps.

:func:`answer_tokens` applies the eval's decoding rule (``KvsieveSession.continue_greedy`` with the
task's stop) to tokens an engine generated greedily past it: the answer ends at the tokenizer's EOS
token (kept, as the session keeps it) or at the first token after which the decoded text matches
the task's ``stop_regex``, whichever comes first.

:func:`compare_outputs` matches the runs of two ``kvsieve eval`` output folders by run folder name
(task, length, model, selector label, budget: e.g. the transformers path and the vLLM path of one
config) and compares them prompt by prompt (same sample index and depth): the same answer text, and
the same pass/fail. ``benchmarks/vllm_quality.py`` uses the same rule and reader.
"""
from __future__ import annotations

import csv
import re
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..store import PREDICTIONS, write_csv

__all__ = ["answer_tokens", "answer_text", "read_predictions", "Agreement", "compare_outputs", "format_agreement",
           "write_agreement", "AGREEMENT_CSV"]

AGREEMENT_CSV = "agreement.csv"


def answer_tokens(tokenizer: Any, ids: list[int], stop_regex: str | None) -> list[int]:
    """The prefix of greedy tokens ``ids`` the eval's decoding loop would have generated (module docstring)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    pattern = None if stop_regex is None else re.compile(stop_regex)
    for n, tok in enumerate(ids, start=1):
        if eos is not None and tok == eos:
            return ids[:n]
        if pattern is not None and pattern.search(tokenizer.decode(ids[:n], skip_special_tokens=True)):
            return ids[:n]
    return list(ids)


def answer_text(tokenizer: Any, ids: list[int], stop_regex: str | None) -> str:
    """The answer of :func:`answer_tokens`, decoded as the eval decodes it."""
    return tokenizer.decode(answer_tokens(tokenizer, ids, stop_regex), skip_special_tokens=True).strip()


def read_predictions(folder: Path, pattern: str = "*") -> dict[str, list[dict[str, str]]]:
    """``{run folder name: predictions.csv rows}`` of the finished runs of an output folder whose
    folder name matches ``pattern`` (a glob, e.g. ``passkey__8192__*``)."""
    runs = {}
    for pred in sorted(Path(folder).glob(f"{pattern}/{PREDICTIONS}")):
        with pred.open(newline="", encoding="utf-8") as f:
            runs[pred.parent.name] = list(csv.DictReader(f))
    return runs


@dataclass(frozen=True)
class Agreement:
    """One run present in both folders: ``n`` prompts, how many gave the same answer text and the
    same pass/fail (score 1 or not), and the prompts (``sample@depth``) whose answers differ."""

    run: str
    selector: str
    budget: str
    n: int
    same_answer: int
    same_pass: int
    differ_on: str


def _prompt_key(row: dict[str, str]) -> str:
    return f"{row['sample']}@{row.get('depth') or '-'}"


def compare_outputs(a: Path, b: Path) -> list[Agreement]:
    """Every run finished in both output folders ``a`` and ``b``, compared prompt by prompt; a run
    whose prompts differ between them (other depths, samples or seed) raises ``ValueError`` naming it."""
    mine, theirs = read_predictions(a), read_predictions(b)
    out = []
    for run in sorted(set(mine) & set(theirs)):
        x, y = mine[run], theirs[run]
        if [_prompt_key(r) for r in x] != [_prompt_key(r) for r in y]:
            raise ValueError(f"run {run}: the prompts differ between {a} and {b} (samples "
                             f"{[_prompt_key(r) for r in x]} vs {[_prompt_key(r) for r in y]}): run both with the "
                             "same depths, samples and seed")
        differ = [_prompt_key(r) for r, s in zip(x, y) if r["prediction"] != s["prediction"]]
        same_pass = sum((float(r["score"]) >= 1.0) == (float(s["score"]) >= 1.0) for r, s in zip(x, y))
        _, _, _, selector, budget = run.split("__")
        out.append(Agreement(run, selector, budget, len(x), len(x) - len(differ), same_pass, " ".join(differ)))
    return out


def format_agreement(rows: list[Agreement]) -> str:
    """Per selector label (dense first): prompts with the same answer in both, over all its runs, then each run."""
    by_sel: dict[str, list[Agreement]] = defaultdict(list)
    for r in rows:
        by_sel[r.selector].append(r)
    lines = ["per-prompt agreement (same answer text; same pass/fail):"]
    for sel in sorted(by_sel, key=lambda s: (s != "dense", s)):
        runs = by_sel[sel]
        n, same, passed = (sum(getattr(r, k) for r in runs) for k in ("n", "same_answer", "same_pass"))
        lines.append(f"  {sel:<16} {same}/{n} = {same / n:.0%} same answer, {passed}/{n} same pass/fail")
        for r in runs:
            lines.append(f"    {r.run}: {r.same_answer}/{r.n}" + (f"; differ on {r.differ_on}" if r.differ_on else ""))
    return "\n".join(lines)


def write_agreement(path: Path, rows: list[Agreement]) -> Path:
    """``rows`` as CSV at ``path``."""
    write_csv(path, [asdict(r) for r in rows], [f for f in Agreement.__dataclass_fields__])
    return path
