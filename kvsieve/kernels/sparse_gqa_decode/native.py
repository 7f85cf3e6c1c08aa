"""Attention of decode tokens over runs of a paged KV cache, on the CPU: the C kernels of
``sparse_gqa_decode.c`` behind ctypes, beside their plain-PyTorch twins (:mod:`.naive`). The torch
backend's single-token path and the integrations' dense fast path (a lone decode token) call
:func:`sparse_decode_native`; the vLLM plug-in's token-granular decode rows call :func:`sparse_decode_runs_native` on vLLM's CPU cache;
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

import ctypes
from pathlib import Path

import numpy as np
import torch

from ..common.native import native_library
from ..common.runs import TokenRuns, runs_call_inputs

__all__ = ["SOURCE", "MAX_D", "MAX_G", "sparse_decode_native", "sparse_decode_runs_native",
           "supports_native", "supports_runs_native"]

SOURCE = Path(__file__).with_name("sparse_gqa_decode.c")
MAX_D, MAX_G = 256, 16  # as in sparse_gqa_decode.c
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_ARGTYPES = [_P, _I, _P, _P, _I, _I64, _I64, _I, _I, _P, _I, _F, _P, _P]
_RUNS_ARGTYPES = [_P, _P, _I, _I64, _P, _P, _P, _P, _I64, _I, _I, _P, _I, _F, _P, _P]


def supports_native(rows: torch.Tensor, q: torch.Tensor, num_kv_heads: int) -> bool:
    """Whether the native kernel takes these inputs (its library may still be unavailable)."""
    return (rows.device.type == "cpu" and q.device.type == "cpu" and rows.is_contiguous()
            and rows.dtype in (torch.bfloat16, torch.float32) and q.shape[1] <= MAX_D
            and q.shape[0] // num_kv_heads <= MAX_G)


def sparse_decode_native(rows: torch.Tensor, k_rows: np.ndarray, cnt: np.ndarray, v_offset: int, q: torch.Tensor,
                         *, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [Hq, D] fp32, lse [Hq] fp32)``; raises ``NativeUnavailable`` when the library is not
    there. The caller has checked :func:`supports_native`; ``k_rows`` int64 and ``cnt`` int32
    ``[Hkv, U]`` are host arrays (numpy, converted to C order here)."""
    fn = native_library(SOURCE).kvsieve_sparse_decode
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    hkv, n_runs = k_rows.shape
    d = q.shape[1]
    kr = np.ascontiguousarray(k_rows, dtype=np.int64)
    cn = np.ascontiguousarray(cnt, dtype=np.int32)
    qf = q.to(torch.float32).contiguous()
    out = torch.empty(q.shape[0], d, dtype=torch.float32)
    lse = torch.empty(q.shape[0], dtype=torch.float32)
    rc = fn(rows.data_ptr(), int(rows.dtype == torch.bfloat16), kr.ctypes.data, cn.ctypes.data, hkv, n_runs,
            v_offset, rows.shape[1] // d, d, qf.data_ptr(), q.shape[0] // hkv, sm_scale, out.data_ptr(), lse.data_ptr())
    if rc != 0:
        raise RuntimeError(f"kvsieve_sparse_decode returned {rc} (D={d}, G={q.shape[0] // hkv})")
    return out, lse


def supports_runs_native(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether :func:`sparse_decode_runs_native` takes these views: ``k``/``v [num_blocks, Hkv,
    block_size, D]`` on CPU, both bf16 or both fp32, V rows of ``D`` contiguous channels, K the same or
    stored by channel (tokens contiguous: vLLM's CPU layout), ``q [N, Hq, D]`` within the kernel's
    head dim and group size."""
    if k.dim() != 4 or k.shape != v.shape or q.dim() != 3:
        return False
    d, hkv = k.shape[3], k.shape[1]
    k_rows = k.stride(3) == 1 and k.stride(2) == d
    return (k.device.type == v.device.type == q.device.type == "cpu" and k.dtype == v.dtype
            and k.dtype in (torch.bfloat16, torch.float32) and v.stride(3) == 1 and v.stride(2) == d
            and (k_rows or k.stride(2) == 1) and q.shape[2] == d and d <= MAX_D and q.shape[1] % hkv == 0
            and q.shape[1] // hkv <= MAX_G)


def sparse_decode_runs_native(k: torch.Tensor, v: torch.Tensor, runs: TokenRuns, q: torch.Tensor, *, sm_scale: float
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [N, Hq, D] fp32, lse [N, Hq] fp32)`` of ``N = runs.num_rows`` decode rows ``q [N, Hq, D]``
    over their runs of the cache views ``k``/``v [num_blocks, Hkv, block_size, D]``, read in place;
    raises ``NativeUnavailable`` when the library is not there. The caller has checked
    :func:`supports_runs_native`."""
    fn = native_library(SOURCE).kvsieve_sparse_decode_runs
    fn.argtypes, fn.restype = _RUNS_ARGTYPES, ctypes.c_int
    k_off, v_off, k_ch, cnt, qf, out, lse = runs_call_inputs(k, v, runs, q)
    n, hq, d = q.shape
    hkv = k.shape[1]
    rc = fn(k.data_ptr(), v.data_ptr(), int(k.dtype == torch.bfloat16), k_ch, runs.ptr.ctypes.data, k_off.ctypes.data,
            v_off.ctypes.data, cnt.ctypes.data, n, hkv, d, qf.data_ptr(), hq // hkv, sm_scale, out.data_ptr(),
            lse.data_ptr())
    if rc != 0:
        raise RuntimeError(f"kvsieve_sparse_decode_runs returned {rc} (D={d}, G={hq // hkv})")
    return out, lse
