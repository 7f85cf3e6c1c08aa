"""Which steps the plug-in's selector serves when vLLM speculates with kvsieve's drafter
(:class:`.drafter.SparseDrafter`, docs/lossless.md), free of vLLM imports.

Under that drafter vLLM runs two kinds of forward passes:

* :data:`OWN_STEP`: every step vLLM schedules itself (prompts, prompt chunks, recomputed requests,
  verify rows of ``K + 1`` tokens). Its attention is vLLM's own dense kernel on vLLM's own metadata;
  the selector still sees the step's new K/V (``on_append``, so Quest's page summaries and DSA's
  index keys are those of the K/V the step wrote, verify rows included) and chooses nothing
  (:attr:`~kvsieve.metadata.AttentionMetadata.dense`). Each row's prompt length is not needed (every
  query token is treated as a context token, attending densely), so the batch table that per-request
  settings ride (vLLM builds no entry-point logits processor under speculation) is not read.
* :data:`DRAFT_STEP`: the drafter's one-token steps, every row one generated token, selected by the
  selector as a decode step. The first of a round is :data:`FIRST_DRAFT_STEP`: the verify pass before
  it summarized every token it wrote, the rejected ones included, so the page of each row's new
  position is recomputed from the cache over its valid positions before the step selects (the
  one-call decode path, :mod:`.native_decode`, by ``refresh_pages``; the selector's Python hooks by
  ``on_append``), where merging the new key into the stored summary would keep the rejected keys.
  Later draft steps append behind valid positions (or start a page), which the merge keeps exact. Rejected
  positions past a request's length are never read: a page is recomputed (or restarted) when a
  position in it is written again, and DSA's index keys are per position.

The plug-in's metadata builder records the common attention metadata of each own step per builder
(:func:`record`); the drafter builds its steps' metadata from those records, inside
:func:`drafting` (so its own builds are not recorded and are built as draft steps).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["DRAFTER", "OWN_STEP", "DRAFT_STEP", "FIRST_DRAFT_STEP", "uses_drafter", "record", "recorded", "drafting", "step_kind"]

#: the ``speculative_config.model`` naming kvsieve's drafter (``method="custom_class"``)
DRAFTER = "kvsieve.integrations.vllm.drafter.SparseDrafter"
OWN_STEP = "own"
DRAFT_STEP = "draft"
FIRST_DRAFT_STEP = "first_draft"

_RECORDS: dict[int, tuple[Any, Any]] = {}  # id(builder) -> (builder, the common metadata of its last own step)
_DRAFTING: list[str | None] = [None]  # the kind of the draft step being run


def uses_drafter(vllm_config: Any) -> bool:
    """Whether ``vllm_config.speculative_config`` names kvsieve's drafter."""
    spec = getattr(vllm_config, "speculative_config", None)
    return spec is not None and spec.method == "custom_class" and spec.model == DRAFTER


def record(builder: Any, common: Any) -> None:
    """Keep ``common`` (vLLM's ``CommonAttentionMetadata``) as ``builder``'s last own step; nothing
    while drafting."""
    if _DRAFTING[0] is None:
        _RECORDS[id(builder)] = (builder, common)


def recorded() -> list[tuple[Any, Any]]:
    """``(builder, common metadata)`` of every builder's last own step, in the order they were built."""
    return list(_RECORDS.values())


@contextmanager
def drafting(first: bool) -> Iterator[None]:
    """One of the drafter's forward passes (``first``: the round's first): the plug-in's builders
    build :data:`FIRST_DRAFT_STEP` or :data:`DRAFT_STEP` metadata and record nothing."""
    _DRAFTING[0] = FIRST_DRAFT_STEP if first else DRAFT_STEP
    try:
        yield
    finally:
        _DRAFTING[0] = None


def step_kind(speculating: bool) -> str | None:
    """The kind of the step being built: ``None`` without kvsieve's drafter (``speculating`` False),
    else the draft step's inside :func:`drafting`, :data:`OWN_STEP` outside."""
    if not speculating:
        return None
    return _DRAFTING[0] or OWN_STEP
