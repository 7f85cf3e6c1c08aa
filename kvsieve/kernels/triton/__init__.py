"""kvsieve Triton kernels (paged GQA/MLA sparse attention) and their helpers.

Each op lives in its own subpackage with ``kernel.py`` (Triton) and ``naive.py`` (plain-PyTorch
reference with the same signature). Launch configurations come from ``launch.py`` only.
"""
from __future__ import annotations

from .dsa_indexer import indexer_logits_decode, indexer_logits_prefill, quantize_pow2_fp8
from .kv_helpers import (compact_kv_, compact_mla_kv_, effective_attended_tokens,
                         to_physical_slots)
from .merge_states import merge_states
from .paged_prefill import paged_prefill, select_prefill_path
from .sparse_gqa_decode import sparse_gqa_decode
from .sparse_mla_decode import sparse_mla_decode
from .topk import TopKDecision, TopKWorkspace, choose_topk_engine, run_topk

__all__ = [
    "indexer_logits_decode", "indexer_logits_prefill", "quantize_pow2_fp8", "TopKDecision", "TopKWorkspace",
    "choose_topk_engine", "run_topk", "compact_kv_", "compact_mla_kv_", "effective_attended_tokens", "merge_states",
    "paged_prefill", "select_prefill_path", "sparse_gqa_decode", "sparse_mla_decode",
    "to_physical_slots",
]
