"""What ``benchmarks/vllm_serve.py`` computes from its requests, in the terms of vLLM's own
``vllm bench serve``: time to first token (TTFT), time per output token after the first (TPOT,
per request), inter-token latency (ITL, every gap between two streamed chunks), each at p50 / p90 /
p99, requests/s and output tokens/s over the span from the first request sent to the last answer;
the check of an exact mode's answers against the ``own`` mode's, and the markdown tables."""
from __future__ import annotations

import math
from dataclasses import dataclass

from benchmarks.vllm_client import Streamed
from kvsieve.eval.served.launch import OWN

__all__ = ["QUANTILES", "Record", "Metrics", "Cell", "percentile", "stats_ms", "summarize", "check_answers",
           "ratios", "markdown_table"]

QUANTILES = (50, 90, 99)


@dataclass(frozen=True)
class Record:
    """One request: its ``key`` (``<session>/<turn>``), when it was sent (seconds from the start of
    its run) and what came back."""

    key: str
    start_s: float
    answer: Streamed

    @property
    def served(self) -> bool:
        """Answered in full: HTTP 200, no failure message, at least one token."""
        return self.answer.status == 200 and not self.answer.message and self.answer.output_tokens > 0


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linear between the two nearest ranks (numpy's
    default, as ``vllm bench serve`` reports); NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: q must be in 0..100, got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def stats_ms(seconds: list[float]) -> dict[str, float]:
    """``{"p50": ms, "p90": ms, "p99": ms}`` of ``seconds``."""
    return {f"p{q}": percentile(seconds, q) * 1e3 for q in QUANTILES}


@dataclass(frozen=True)
class Metrics:
    """One run's figures (module docstring); ``failed``: each request not served in full, with why;
    ``prompt_tokens``: the fewest and the most prompt tokens of a served request (the server's count)."""

    requests: int
    served: int
    failed: tuple[str, ...]
    prompt_tokens: tuple[int, int]
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float


def summarize(records: list[Record]) -> Metrics:
    """The :class:`Metrics` of ``records`` (served ones only, in the latencies and the rates)."""
    served = [r for r in records if r.served]
    failed = tuple(f"{r.key}: HTTP {r.answer.status} {r.answer.message}"[:300] for r in records if not r.served)
    ttft = [r.answer.chunk_s[0] for r in served]
    tpot = [(r.answer.chunk_s[-1] - r.answer.chunk_s[0]) / (r.answer.output_tokens - 1)
            for r in served if r.answer.output_tokens > 1]
    itl = [b - a for r in served for a, b in zip(r.answer.chunk_s, r.answer.chunk_s[1:])]
    span = (max(r.start_s + r.answer.total_s for r in records) - min(r.start_s for r in records)) if records else 0.0
    rate = (lambda n: n / span) if span > 0 else (lambda n: math.nan)
    prompts = [r.answer.prompt_tokens for r in served]
    return Metrics(len(records), len(served), failed, (min(prompts, default=0), max(prompts, default=0)),
                   stats_ms(ttft), stats_ms(tpot), stats_ms(itl), span, rate(len(served)),
                   rate(sum(r.answer.output_tokens for r in served)))


@dataclass(frozen=True)
class Cell:
    """A workload run at one concurrency in one mode."""

    workload: str
    mode: str
    concurrency: int
    metrics: Metrics


def check_answers(answers: dict[str, dict[str, str]], exact: list[str]) -> list[str]:
    """Every request of an ``exact`` mode whose answer is not the ``own`` mode's answer of the same
    key (``answers``: mode -> key -> text; a key one of the two lacks, e.g. refused, differs too),
    shown from the first character that differs."""
    problems = []
    for mode in exact:
        ref, got = answers[OWN], answers[mode]
        for key in sorted(set(ref) | set(got)):
            a, b = got.get(key), ref.get(key)
            if a == b:
                continue
            if a is None or b is None:
                problems.append(f"{mode} {key}: answered in {'own' if a is None else mode} only")
                continue
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            problems.append(f"{mode} {key}: differs from own at character {at}: {a[at:at + 60]!r} vs {b[at:at + 60]!r}")
    return problems


def ratios(cells: list[Cell]) -> dict[tuple[str, str, int], dict[str, float]]:
    """Per (workload, mode, concurrency): output tokens/s, TPOT p50 and TTFT p99 over the ``own``
    mode's at the same workload and concurrency."""
    own = {(c.workload, c.concurrency): c.metrics for c in cells if c.mode == OWN}
    out = {}
    for c in cells:
        base = own.get((c.workload, c.concurrency))
        if base is None:
            raise ValueError(f"no {OWN!r} run of {c.workload} at concurrency {c.concurrency} to compare with")
        m = c.metrics
        div = lambda a, b: a / b if b and not math.isnan(b) else math.nan  # noqa: E731
        out[(c.workload, c.mode, c.concurrency)] = {
            "output_tokens_per_s": div(m.output_tokens_per_s, base.output_tokens_per_s),
            "tpot_p50": div(m.tpot_ms["p50"], base.tpot_ms["p50"]),
            "ttft_p99": div(m.ttft_ms["p99"], base.ttft_ms["p99"])}
    return out


def _f(x: float, digits: int = 0) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}"


def markdown_table(cells: list[Cell], workload: str) -> str:
    """The markdown table of ``workload``'s cells: a row per mode and concurrency, latencies in ms."""
    rel = ratios(cells)
    head = ("| mode | conc. | served | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | ITL p50 | ITL p99 | req/s | "
            "out tok/s | tok/s x own | TPOT p50 x own | TTFT p99 x own |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in cells:
        if c.workload != workload:
            continue
        m, r = c.metrics, rel[(c.workload, c.mode, c.concurrency)]
        lines.append(f"| {c.mode} | {c.concurrency} | {m.served}/{m.requests} | {_f(m.ttft_ms['p50'])} | "
                     f"{_f(m.ttft_ms['p99'])} | {_f(m.tpot_ms['p50'], 1)} | {_f(m.tpot_ms['p99'], 1)} | "
                     f"{_f(m.itl_ms['p50'], 1)} | {_f(m.itl_ms['p99'], 1)} | {_f(m.requests_per_s, 3)} | "
                     f"{_f(m.output_tokens_per_s, 1)} | {_f(r['output_tokens_per_s'], 2)} | {_f(r['tpot_p50'], 2)} | "
                     f"{_f(r['ttft_p99'], 2)} |")
    return "\n".join(lines)
