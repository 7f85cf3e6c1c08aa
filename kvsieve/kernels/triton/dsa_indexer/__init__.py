"""DSA lightning-indexer logits: ragged prefill and paged decode (Triton + references), and the
FP8 index-key quantizer of the aux pool."""
from __future__ import annotations

from .kernel import indexer_logits_decode, indexer_logits_prefill
from .quant import quantize_pow2_fp8

__all__ = ["indexer_logits_decode", "indexer_logits_prefill", "quantize_pow2_fp8"]
