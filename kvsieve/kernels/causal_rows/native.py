"""Attention of each request's last query rows over its paged KV cache, each row causal, on the CPU:
the C kernel of ``causal_rows.c`` behind ctypes, beside its plain-PyTorch twin (:mod:`.naive`). The
vLLM plug-in's verify passes (lossless decoding: ``K + 1`` rows a request) call it on vLLM's CPU cache.

Inputs:

* ``k``, ``v [num_blocks, Hkv, block_size, D]`` bf16 or fp32 views of a paged cache (any block and
  head strides): V rows of ``D`` contiguous channels; K the same, or stored by channel (tokens
  contiguous, ``k.stride(2) == 1``: vLLM's CPU layout, then ``block_size % 16 == 0``).
* ``block_table [n_req, >= blocks]`` int32 (numpy): each request's physical cache blocks in order.
* ``qo_indptr [n_req + 1]`` int64 (numpy): request ``r``'s query rows are ``[qo_indptr[r],
  qo_indptr[r + 1])`` of ``q``, its last positions in order.
* ``kv_lens [n_req]`` int64 (numpy): positions cached per request, this step's rows included; row ``i``
  of a request with ``R`` rows attends positions ``[0, kv_len - R + i + 1)``.
* ``q [N, Hq, D]`` (any float dtype; query head ``j`` in KV group ``j // G``).

Returns ``out [N, Hq, D]`` fp32 and the natural-log ``lse [N, Hq]`` fp32 of ``softmax(sm_scale q k)``.
A request's rows and its ``G`` query heads per KV head are folded into one group of ``R * G`` heads,
so each cache block is read once for all of them; the later positions of a tile are masked per row.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from ..common.native import native_library

__all__ = ["MAX_FOLDED", "SOURCE", "causal_rows_native", "supports_causal_rows"]

SOURCE = Path(__file__).with_name("causal_rows.c")
MAX_FOLDED, MAX_D = 32, 256  # as in causal_rows.c: a task's folded heads (rows x group), the head dim
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_ARGTYPES = [_P, _P, _I, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I, _P, _I64, _P, _P, _I64, _I, _I, _P, _I, _F,
             _I, _P, _P]


def supports_causal_rows(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether :func:`causal_rows_native` takes these views (module docstring): CPU, both bf16 or both
    fp32, V rows of ``D`` contiguous channels, K by rows or by channel (then ``block_size % 16 == 0``),
    ``D`` a multiple of 8 up to 256, a query group of at most 32 heads."""
    if k.dim() != 4 or k.shape != v.shape or q.dim() != 3:
        return False
    d, hkv, bs = k.shape[3], k.shape[1], k.shape[2]
    k_rows = k.stride(3) == 1
    k_cols = k.stride(2) == 1 and bs % 16 == 0
    return (k.device.type == v.device.type == q.device.type == "cpu" and k.dtype == v.dtype
            and k.dtype in (torch.bfloat16, torch.float32) and v.stride(3) == 1 and (k_rows or k_cols)
            and q.shape[2] == d and d % 8 == 0 and d <= MAX_D and q.shape[1] % hkv == 0
            and q.shape[1] // hkv <= MAX_FOLDED)


def causal_rows_native(k: torch.Tensor, v: torch.Tensor, block_table: np.ndarray, qo_indptr: np.ndarray,
                       kv_lens: np.ndarray, q: torch.Tensor, *, sm_scale: float, threads: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [N, Hq, D] fp32, lse [N, Hq] fp32)`` (module docstring); ``threads``: OpenMP threads
    (``None``: torch's count). Raises ``NativeUnavailable`` when the library is not there and
    ``ValueError`` (nothing computed) for threads below 1, ``q`` rows other than ``qo_indptr``'s or a
    block table narrower than ``kv_lens`` need; the caller has checked :func:`supports_causal_rows`."""
    if threads is not None and threads < 1:
        raise ValueError(f"causal_rows_native: threads must be >= 1 (or None for torch's count), got {threads}")
    if len(qo_indptr) != len(kv_lens) + 1:
        raise ValueError(f"causal_rows_native: qo_indptr has {len(qo_indptr)} entries for {len(kv_lens)} requests "
                         f"(expected one more)")
    if q.shape[0] != int(qo_indptr[-1]):
        raise ValueError(f"causal_rows_native: q has {q.shape[0]} rows, qo_indptr ends at {int(qo_indptr[-1])}")
    fn = native_library(SOURCE).kvsieve_causal_rows
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    n, hq, d = q.shape
    hkv, bs = k.shape[1], k.shape[2]
    table = np.ascontiguousarray(block_table, dtype=np.int32)
    if table.ndim != 2 or table.shape[0] < len(kv_lens):
        raise ValueError(f"causal_rows_native: block_table must be [n_req >= {len(kv_lens)}, blocks], "
                         f"got shape {table.shape}")
    qo = np.ascontiguousarray(qo_indptr, dtype=np.int64)
    lens = np.ascontiguousarray(kv_lens, dtype=np.int64)
    qf = q.to(torch.float32).contiguous()
    out = torch.empty(n, hq, d, dtype=torch.float32)
    lse = torch.empty(n, hq, dtype=torch.float32)
    sk, sv = k.stride(), v.stride()
    rc = fn(k.data_ptr(), v.data_ptr(), int(k.dtype == torch.bfloat16), sk[0], sk[1], sk[2], sk[3], sv[0], sv[1],
            sv[2], bs, table.ctypes.data, table.shape[1], qo.ctypes.data, lens.ctypes.data,
            lens.size, hkv, d, qf.data_ptr(), hq // hkv, sm_scale, threads or torch.get_num_threads(),
            out.data_ptr(), lse.data_ptr())
    if rc == -3:
        raise ValueError(f"causal_rows_native: block_table has {table.shape[1]} blocks a row, fewer than kv_lens "
                         f"{lens.tolist()} need at {bs} positions a block")
    if rc != 0:
        raise RuntimeError(f"kvsieve_causal_rows returned {rc} (D={d}, G={hq // hkv}, block_size={bs})")
    return out, lse
