"""Attention of a prompt's query rows over runs of a paged cache, on the CPU: the C kernel of
``prompt_runs.c`` behind ctypes, beside its plain-PyTorch twin (:mod:`.naive`). The vLLM plug-in's
prompt rows that select positions (DSA in the prompt) call :func:`prompt_runs_native` on vLLM's CPU
cache.

Inputs and result are those of
:func:`~kvsieve.kernels.sparse_gqa_decode.native.sparse_decode_runs_native` (``k``, ``v
[num_blocks, Hkv, block_size, D]`` bf16 or fp32 views, K rows of ``D`` or stored by channel, V rows of
``D``; ``runs`` a :class:`~kvsieve.kernels.sparse_gqa_decode.runs.TokenRuns`; ``q [N, Hq, D]`` ->
``out [N, Hq, D]`` fp32 and the natural-log ``lse [N, Hq]`` fp32, a (row, KV head) without tokens: out 0,
lse ``+inf``), and the inputs that kernel takes this one takes
(:func:`~kvsieve.kernels.sparse_gqa_decode.native.supports_runs_native`). The loop order differs: a
decode row reads each of its blocks once, cold, while a prompt's neighbouring rows select mostly the
same blocks; here the rows go in tiles of 32 per KV head, and a tile visits its runs block by block
(first the logits of every selected token, then per (row, query head) the softmax, then the weighted V
rows, block by block again). Where the tile's rows select at least a third of the (row, token) pairs
of the span their runs cover in a block (a window, whole pages, a dense prefix), that block is a small
matrix product: its K and V are packed once to fp32 and every row of the tile reads them from the
L1, query heads side by side against 16 tokens a vector; elsewhere the rows take their selected
tokens one by one. The tiles and KV heads are spread over OpenMP threads. Each logit is a sum over the
channels in order on both forms, and a row's weighted V rows are added in its tokens' order (an
unselected token of the matrix form adds weight 0); the softmax is taken over all of a row's logits at
once (not online), so the result agrees with the decode kernel's to fp32 rounding.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from ..common.native import native_library
from ..common.runs import TokenRuns, runs_call_inputs

__all__ = ["SOURCE", "prompt_runs_native"]

SOURCE = Path(__file__).with_name("prompt_runs.c")
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_ARGTYPES = [_P, _P, _I, _I64, _P, _P, _P, _P, _P, _P, _I64, _I, _I, _I, _P, _I, _F, _P, _P]


def prompt_runs_native(k: torch.Tensor, v: torch.Tensor, runs: TokenRuns, q: torch.Tensor, *, sm_scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [N, Hq, D] fp32, lse [N, Hq] fp32)`` of ``N = runs.num_rows`` prompt rows ``q [N, Hq, D]``
    over their runs of the cache views ``k``/``v [num_blocks, Hkv, block_size, D]``, read in place;
    raises ``NativeUnavailable`` when the library is not there. The caller has checked
    :func:`~kvsieve.kernels.sparse_gqa_decode.native.supports_runs_native`."""
    fn = native_library(SOURCE).kvsieve_prompt_runs
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    k_off, v_off, k_ch, cnt, qf, out, lse = runs_call_inputs(k, v, runs, q)
    n, hq, d = q.shape
    hkv = k.shape[1]
    blk = np.ascontiguousarray(runs.block, dtype=np.int64)
    start = np.ascontiguousarray(runs.start, dtype=np.int64)
    rc = fn(k.data_ptr(), v.data_ptr(), int(k.dtype == torch.bfloat16), k_ch, runs.ptr.ctypes.data, blk.ctypes.data,
            start.ctypes.data, k_off.ctypes.data, v_off.ctypes.data, cnt.ctypes.data, n, hkv, d, k.shape[2],
            qf.data_ptr(), hq // hkv, sm_scale, out.data_ptr(), lse.data_ptr())
    if rc != 0:
        raise RuntimeError(f"kvsieve_prompt_runs returned {rc} (D={d}, G={hq // hkv})")
    return out, lse
