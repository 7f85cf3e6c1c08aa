"""CuTe-DSL sparse absorbed-MLA decode (SM90 wgmma / SM100 tcgen05), bf16 or FP8 latent cache.

Kernel modules (``sm90``, ``sm100``, ``tile_ops``) import ``cutlass`` and are loaded lazily;
``host`` and ``naive`` import only torch and kvsieve.kernels.triton helpers.
"""
from __future__ import annotations

from .host import sparse_mla_decode, sparse_mla_decode_slots
from .naive import dequantize_fp8_mla, quantize_fp8_mla, sparse_mla_decode_fp8_reference

__all__ = ["dequantize_fp8_mla", "quantize_fp8_mla", "sparse_mla_decode",
           "sparse_mla_decode_fp8_reference", "sparse_mla_decode_slots"]
