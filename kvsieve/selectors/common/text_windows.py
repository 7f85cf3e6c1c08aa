"""Token windows of a calibration step's text corpus (:class:`kvsieve.sparse.calibration.Document`): the
train / held-out split of the essays, and windows of ``seq_len`` tokens cut from documents joined
in order with a space, each starting with the tokenizer's special prefix as an eval prompt does.
"""
from __future__ import annotations

from typing import Any

import torch

from ...sparse.calibration import Document

__all__ = ["split_documents", "special_prefix", "token_windows"]

_MAX_CHARS_PER_TOKEN = 12  # enough text is read for this many characters per token


def split_documents(docs: list[Document], holdout_every: int = 2) -> tuple[list[Document], list[Document]]:
    """``(train, held_out)``: every ``holdout_every``-th essay (in the given order, starting with the
    first) is held out; everything else trains. Held-out texts are essays because the eval's
    haystacks are."""
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


def token_windows(tokenizer: Any, docs: list[Document], seq_len: int, count: int | None) -> list[torch.Tensor]:
    """``count`` non-overlapping windows ``[1, seq_len]`` of the documents joined in order (``None``:
    every whole window they hold), each starting with the tokenizer's special prefix
    (:func:`special_prefix`): a model whose attention sinks on ``<bos>`` (Gemma 3) attends quite
    differently without it. Refuses when the documents hold fewer tokens than asked for (with
    ``None``: than one window)."""
    prefix = special_prefix(tokenizer)
    body = seq_len - len(prefix)
    if body < 1:
        raise ValueError(f"token_windows: seq_len {seq_len} leaves no room after the special prefix {prefix}")
    texts, chars = [], 0
    for d in docs:  # joined with a space and encoded at once, as the eval's haystacks are
        texts.append(d.text)
        chars += len(d.text) + 1
        if count is not None and chars >= count * body * _MAX_CHARS_PER_TOKEN:
            break
    ids = tokenizer.encode(" ".join(texts), add_special_tokens=False)
    need = max(len(ids) // body, 1) if count is None else count
    if len(ids) < need * body:
        raise ValueError(f"token_windows: {len(docs)} documents give {len(ids)} tokens; {need} windows of "
                         f"{seq_len} need {need * body}")
    return [torch.tensor(prefix + ids[j * body: (j + 1) * body]).unsqueeze(0) for j in range(need)]
