"""DSA's selection for many rows in one native call: the C kernel of ``prompt_index.c`` behind ctypes,
beside its plain-PyTorch twin (:mod:`.naive`). :class:`~kvsieve.selectors.dsa.DSASelector` calls it on
the CPU for the rows it indexes (a prompt's rows, and any other rows of a step that is not the one-call
decode).

Inputs: ``pool [num_blocks, block_size, id]`` bf16 or fp32 index keys (contiguous; the aux pool
``dsa_index_k``), ``table [R, W]`` int32 physical blocks, ``slots [n]`` int32 (row ``n``'s table row;
rows of one request consecutive), ``lens [n]`` int32 (row ``n`` sees positions ``0 .. lens[n] - 1``),
``q [n, ih, id]`` and ``w [n, ih]`` fp32 (the index queries, rounded as the pool's keys, and the head
weights, every scale folded in), ``k``. Result: ``[n, k]`` int32, per row the ``k`` positions of the
highest score ``I[p] = sum_h w[h] * relu(q[h] . key[p])`` (ties to the lower position; every position
when ``lens[n] <= k``), ascending, ``-1`` after.

The rows of a request go in tiles of 16: each 16-position tile of keys is read and transposed once
and scored for every row of the tile that sees it (the heads' terms added in order, each dot product
over the channels in order: the one-call decode kernel's sums on a CPU without AVX512-BF16), so no
``[rows x len]`` score matrix exists beyond a tile's; the top-k is a radix select per row. The scores
differ from the reference's (a torch ``einsum``) in the last bits, so where two positions' scores tie
to those bits either may be taken.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from ..common.native import native_library

__all__ = ["SOURCE", "prompt_index_topk_native", "supports_prompt_index"]

SOURCE = Path(__file__).with_name("prompt_index.c")
MAX_ID, MAX_H = 256, 64  # as in vec_math.h / index_score.h
_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_ARGTYPES = [_P, _I, _I, _I64, _P, _I64, _P, _P, _I64, _P, _P, _I, _I64, _P]


def supports_prompt_index(pool: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether the kernel takes this pool and these queries (its library may still be unavailable):
    a contiguous bf16/fp32 pool on the CPU, ``id <= 256``, ``ih <= 64``."""
    return (pool.device.type == q.device.type == "cpu" and pool.dim() == 3 and pool.is_contiguous()
            and pool.dtype in (torch.bfloat16, torch.float32) and q.dim() == 3 and q.shape[2] == pool.shape[2]
            and q.shape[2] <= MAX_ID and q.shape[1] <= MAX_H)


def prompt_index_topk_native(pool: torch.Tensor, table: np.ndarray, slots: np.ndarray, lens: np.ndarray,
                             q: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    """int32 ``[n, k]`` (module docstring); raises ``NativeUnavailable`` when the library is not
    there. The caller has checked :func:`supports_prompt_index`."""
    fn = native_library(SOURCE).kvsieve_prompt_index_topk
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    tab = np.ascontiguousarray(table, dtype=np.int32)
    sl, ln = (np.ascontiguousarray(a, dtype=np.int32) for a in (slots, lens))
    qf, wf = q.to(torch.float32).contiguous(), w.to(torch.float32).contiguous()
    n, ih, id_ = qf.shape
    out = torch.empty(n, k, dtype=torch.int32)
    rc = fn(pool.data_ptr(), int(pool.dtype == torch.bfloat16), id_, pool.shape[1], tab.ctypes.data, tab.shape[1],
            sl.ctypes.data, ln.ctypes.data, n, qf.data_ptr(), wf.data_ptr(), ih, k, out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"kvsieve_prompt_index_topk returned {rc} (id={id_}, ih={ih}, k={k})")
    return out
