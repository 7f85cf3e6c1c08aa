"""The C kernel of :func:`~kvsieve.kernels.page_topk.plan.page_topk` (``page_topk.c``) behind ctypes."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from ..common.native import native_library

__all__ = ["SOURCE", "MAX_D", "MAX_G", "page_topk_native", "page_topk_rows_native"]

SOURCE = Path(__file__).with_name("page_topk.c")
MAX_D, MAX_G = 256, 16  # as in page_topk.c
_MODES = {"bound": 0, "sign": 1}
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_ARGTYPES = [_P, _I, _P, _I64, _I, _I, _I, _P, _I, _F, _I, _I64, _P, _P]
_ROWS_ARGTYPES = [_P, _I, _P, _I64, _P, _P, _I64, _I, _I, _I, _P, _I, _F, _I, _P]


def page_topk_native(pool: torch.Tensor, block_ids: torch.Tensor, n_pages: int, q: torch.Tensor, *,
                     sm_scale: float, mode: str, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices [Hkv, k] int32 ascending, scores [Hkv, n_pages] fp32)``; the caller has checked
    that the inputs are what the kernel takes (``supports_native``)."""
    fn = native_library(SOURCE).kvsieve_page_topk
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    _, hkv, sub, _, d = pool.shape
    qf = q.to(torch.float32).contiguous()
    ids = block_ids.to(torch.int64).contiguous()
    scores = torch.empty(hkv, n_pages, dtype=torch.float32)
    sel = torch.empty(hkv, k, dtype=torch.int32)
    rc = fn(pool.data_ptr(), int(pool.dtype == torch.bfloat16), ids.data_ptr(), n_pages, hkv, sub, d,
            qf.data_ptr(), q.shape[0] // hkv, sm_scale, _MODES[mode], k, scores.data_ptr(), sel.data_ptr())
    if rc != 0:
        raise RuntimeError(f"kvsieve_page_topk returned {rc} (D={d}, G={q.shape[0] // hkv}, k={k}, "
                           f"n_pages={n_pages})")
    return sel, scores


def page_topk_rows_native(pool: torch.Tensor, table: np.ndarray, n_pages: np.ndarray, q: torch.Tensor, *,
                          sm_scale: float, mode: str, ks: np.ndarray) -> torch.Tensor | None:
    """``indices [Hkv, sum(ks)]`` int32 of ``q [N, Hq, D]``'s rows (row ``n``'s ``ks[n]`` pages per head
    after those of the rows before it); ``table [N, W]``, ``n_pages``/``ks [N]`` int64 contiguous.
    ``None`` when a row's ``k`` is outside ``[1, n_pages]`` or its pages past its table row (the
    kernel checks them; the caller then names the error); the caller has checked the shapes."""
    fn = native_library(SOURCE).kvsieve_page_topk_rows
    fn.argtypes, fn.restype = _ROWS_ARGTYPES, ctypes.c_int
    _, hkv, sub, _, d = pool.shape
    qf = q.to(torch.float32).contiguous()
    sel = torch.empty(hkv, int(ks.sum()), dtype=torch.int32)
    rc = fn(pool.data_ptr(), int(pool.dtype == torch.bfloat16), table.ctypes.data, table.shape[1], n_pages.ctypes.data,
            ks.ctypes.data, q.shape[0], hkv, sub, d, qf.data_ptr(), q.shape[1] // hkv, sm_scale, _MODES[mode],
            sel.data_ptr())
    if rc == -1:
        return None
    if rc != 0:
        raise RuntimeError(f"kvsieve_page_topk_rows returned {rc} (D={d}, G={q.shape[1] // hkv})")
    return sel
