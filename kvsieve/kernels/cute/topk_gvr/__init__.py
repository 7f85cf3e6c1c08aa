"""CuTe-DSL GVR top-k (Guess-Verify-Refine, self-sampling) for SM90/SM100/SM103: one CTA per row,
shared-memory histogram and candidate scratch, exact with the Triton kernels' tie rule.

``kernel.gvr_topk(scores, lengths, k, out)`` is what ``kvsieve.kernels.triton.topk.dispatch``
calls for the ``cute_gvr`` engine; importing this package needs neither a GPU nor ``cutlass``.
"""
from __future__ import annotations

from .kernel import SUPPORTED_K, gvr_topk

__all__ = ["gvr_topk", "SUPPORTED_K"]
