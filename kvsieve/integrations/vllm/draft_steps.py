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
  selector as a decode step.

The plug-in's metadata builder records the common attention metadata of each own step per builder
(:func:`record`); the drafter builds its steps' metadata from those records, inside
:func:`drafting` (so its own builds are not recorded and are built as draft steps).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["DRAFTER", "OWN_STEP", "DRAFT_STEP", "uses_drafter", "record", "recorded", "drafting", "step_kind"]

#: the ``speculative_config.model`` naming kvsieve's drafter (``method="custom_class"``)
DRAFTER = "kvsieve.integrations.vllm.drafter.SparseDrafter"
OWN_STEP = "own"
DRAFT_STEP = "draft"

_RECORDS: dict[int, tuple[Any, Any]] = {}  # id(builder) -> (builder, the common metadata of its last own step)
_DRAFTING = [False]


def uses_drafter(vllm_config: Any) -> bool:
    """Whether ``vllm_config.speculative_config`` names kvsieve's drafter."""
    spec = getattr(vllm_config, "speculative_config", None)
    return spec is not None and spec.method == "custom_class" and spec.model == DRAFTER


def record(builder: Any, common: Any) -> None:
    """Keep ``common`` (vLLM's ``CommonAttentionMetadata``) as ``builder``'s last own step; nothing
    while drafting."""
    if not _DRAFTING[0]:
        _RECORDS[id(builder)] = (builder, common)


def recorded() -> list[tuple[Any, Any]]:
    """``(builder, common metadata)`` of every builder's last own step, in the order they were built."""
    return list(_RECORDS.values())


@contextmanager
def drafting() -> Iterator[None]:
    """The drafter's forward passes: the plug-in's builders build :data:`DRAFT_STEP` metadata."""
    _DRAFTING[0] = True
    try:
        yield
    finally:
        _DRAFTING[0] = False


def step_kind(speculating: bool) -> str | None:
    """The kind of the step being built: ``None`` without kvsieve's drafter (``speculating`` False),
    else :data:`DRAFT_STEP` inside :func:`drafting`, :data:`OWN_STEP` outside."""
    if not speculating:
        return None
    return DRAFT_STEP if _DRAFTING[0] else OWN_STEP
