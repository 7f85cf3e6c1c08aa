"""Attention of decode tokens over runs of a paged KV cache, on the CPU: the native C kernels
beside their plain-PyTorch ``naive`` twins. The torch backend's single-token path and the
integrations' dense fast path (a lone decode token) call :func:`sparse_decode_native`; the vLLM
plug-in's token-granular decode rows call :func:`sparse_decode_runs_native` on vLLM's CPU cache;
each caller keeps its own PyTorch path where the library is unavailable.

:func:`sparse_decode_native` (one decode token), inputs:

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

:func:`sparse_decode_runs_native` (many decode rows, one call), inputs:

* ``k``, ``v [num_blocks, Hkv, block_size, D]`` bf16 or fp32 views of a paged cache (any block and
  head strides): V rows of ``D`` contiguous channels; K the same, or stored by channel (tokens
  contiguous, ``k.stride(2) == 1``: vLLM's CPU layout, whose K tile is ``[D, block_size]``).
* ``runs`` (:class:`~.runs.TokenRuns`, built by :func:`~.runs.selection_runs` from a selection and
  the block table, in C, or by its numpy twin :func:`~.runs.selection_runs_naive`): per (row, KV
  head) its runs of consecutive positions inside one block.
* ``q [N, Hq, D]``.

Returns ``out [N, Hq, D]`` fp32 and ``lse [N, Hq]`` fp32, as above per row. With K stored by channel
the kernel scores a run's tokens channel by channel (each channel's tokens contiguous): a run of one
token reads ``D`` cache lines of K, a run of 32 bf16 tokens the same ``D`` lines.
"""
from __future__ import annotations

from .naive import sparse_decode_naive, sparse_decode_runs_naive
from .native import sparse_decode_native, sparse_decode_runs_native, supports_native, supports_runs_native
from .runs import TokenRuns, selection_runs, selection_runs_naive

__all__ = ["TokenRuns", "selection_runs", "selection_runs_naive", "sparse_decode_naive", "sparse_decode_native", "sparse_decode_runs_naive",
           "sparse_decode_runs_native", "supports_native", "supports_runs_native"]
