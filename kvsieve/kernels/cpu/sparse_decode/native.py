"""The C kernel of :mod:`kvsieve.kernels.cpu.sparse_decode` (``sparse_decode.c``) behind ctypes."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from ..build import native_library

__all__ = ["SOURCE", "MAX_D", "MAX_G", "sparse_decode_native", "supports_native"]

SOURCE = Path(__file__).with_name("sparse_decode.c")
MAX_D, MAX_G = 256, 16  # as in sparse_decode.c
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_ARGTYPES = [_P, _I, _P, _P, _I, _I64, _I64, _I, _I, _P, _I, _F, _P, _P]


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
