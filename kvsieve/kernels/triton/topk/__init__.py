"""Exact per-row top-k engines (``radix``, ``gvr`` in Triton; ``torch``), their references and
the one dispatch predicate (``dispatch.choose_topk_engine``)."""
from __future__ import annotations

from .dispatch import TopKDecision, TopKWorkspace, choose_topk_engine, run_topk

__all__ = ["TopKDecision", "TopKWorkspace", "choose_topk_engine", "run_topk"]
