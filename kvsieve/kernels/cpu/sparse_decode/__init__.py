"""Attention of one decode token over runs of a paged KV cache, on the CPU: the native C kernel
beside its plain-PyTorch ``naive`` twin. The torch backend's single-token path and the
integrations' dense fast path (a lone decode token) call the native kernel, and keep their own
PyTorch paths where the library is unavailable.

Inputs:

* ``rows [R, unit * D]`` bf16 or fp32 (native), contiguous: the KV pool viewed as rows of ``unit``
  consecutive tokens of one head, K and V alike.
* ``k_rows [Hkv, U]`` int64: the K row of run ``u`` of KV head ``h``; its V row is
  ``k_rows + v_offset``.
* ``cnt [Hkv, U]`` int32: the run's valid tokens, its first ``cnt`` (0 = the run is skipped).
* ``q [Hq, D]`` (any float dtype; ``Hq = Hkv * G``, query head ``j`` in KV group ``j // G``).

Returns ``out [Hq, D]`` fp32 and the natural-log ``lse [Hq]`` fp32 of ``softmax(sm_scale q k)``
over the valid tokens; a head with none has out 0 and lse ``+inf``. The native kernel reads the
rows in place (no gather, no fp32 copy) with an online softmax over chunks of 64 tokens; its
``exp`` is a vectorized Cephes polynomial (~1 ulp), so it matches the naive twin to fp32 rounding.
"""
from __future__ import annotations

from .naive import sparse_decode_naive
from .native import sparse_decode_native, supports_native

__all__ = ["sparse_decode_naive", "sparse_decode_native", "supports_native"]
