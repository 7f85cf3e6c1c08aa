"""The C kernel of one attention layer's decode step (``decode_layer.c``) behind ctypes.

:class:`DecodeLayerCall` binds a layer's cache views, its :class:`DecodeProgram` and its geometry
once (a ctypes structure filled at construction); :meth:`DecodeLayerCall.run` sets the step's
pointers and makes one foreign call, so a layer's host work per step is a few field writes.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from ..common.native import native_library
from .plan import KINDS, MODES, DecodeProgram, IndexerStep

__all__ = ["SOURCE", "DecodeLayerCall", "supports_decode_layer"]

SOURCE = Path(__file__).with_name("decode_layer.c")
_ERRORS = {-1: "a shape or program field outside what the kernel takes", -2: "out of memory",
           -3: "a row's blocks lie outside its block table or the cache", -4: "an unknown program kind"}
_I32, _I64, _P, _F = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Args(ctypes.Structure):
    """``DecodeLayerArgs`` of ``decode_layer.c``, field by field."""

    _fields_ = [
        ("n_rows", _I64), ("table", _P), ("table_stride", _I64), ("table_width", _I64), ("kv_lens", _P),
        ("k", _P), ("v", _P), ("k_blk", _I64), ("k_head", _I64), ("k_tok", _I64), ("k_ch", _I64),
        ("v_blk", _I64), ("v_head", _I64), ("v_tok", _I64), ("num_blocks", _I64),
        ("kv_bf16", _I32), ("block_size", _I32), ("hkv", _I32), ("D", _I32), ("G", _I32), ("sm_scale", _F),
        ("q", _P), ("out", _P), ("q_stride", _I64), ("out_stride", _I64), ("q_bf16", _I32), ("out_bf16", _I32),
        ("kind", _I32), ("mode", _I32), ("unit", _I32), ("num_sink", _I32), ("init_units", _I32),
        ("local_units", _I32), ("units", _I64),
        ("pool", _P), ("pool_bf16", _I32), ("pool_sub", _I32), ("page_size", _I32), ("ih", _I32),
        ("ik", _P), ("iq", _P), ("iw", _P), ("ik_new", _P), ("ik_bf16", _I32), ("id", _I32),
        ("attended", _P), ("threads", _I32),
    ]


def _kv_layout(k: torch.Tensor, v: torch.Tensor) -> bool:
    """K ``[num_blocks, Hkv, block_size, D]`` by rows (channels contiguous) or by channel (tokens
    contiguous), V by rows, both bf16 or fp32 on the CPU with the same block and head strides' meaning."""
    d = k.shape[-1]
    k_ok = (k.stride(3) == 1 and k.stride(2) == d) or k.stride(2) == 1
    return (k.dim() == 4 and k.shape == v.shape and k.dtype == v.dtype and k.dtype in (torch.bfloat16, torch.float32)
            and k.device.type == v.device.type == "cpu" and k_ok and v.stride(3) == 1 and v.stride(2) == d)


def supports_decode_layer(k: torch.Tensor, v: torch.Tensor, num_q_heads: int, program: DecodeProgram) -> bool:
    """Whether :class:`DecodeLayerCall` takes this cache and program (its library may still be
    unavailable): the layouts of :func:`_kv_layout`, head dim <= 256, group <= 16, pools bf16/fp32."""
    hkv, d = k.shape[1], k.shape[3]
    pools = [p for p in (program.pool, program.index_keys) if p is not None]
    return (_kv_layout(k, v) and d <= 256 and num_q_heads % hkv == 0 and num_q_heads // hkv <= 16
            and all(p.dtype in (torch.bfloat16, torch.float32) and p.is_contiguous() for p in pools)
            and (program.index_keys is None or program.index_keys.shape[-1] <= 256))


class DecodeLayerCall:
    """One layer's decode steps through ``kvsieve_decode_layer``: ``k``/``v [num_blocks, Hkv,
    block_size, D]`` views of the layer's cache (:func:`supports_decode_layer`), ``num_q_heads``
    query heads, ``sm_scale``; ``threads``: how many threads a call may use (``None``: torch's
    OpenMP thread count when it is called; the kernel shares that runtime). Raises
    ``NativeUnavailable`` when the library is not there."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, program: DecodeProgram, *, num_q_heads: int,
                 sm_scale: float, threads: int | None = None) -> None:
        if threads is not None and threads < 1:
            raise ValueError(f"DecodeLayerCall: threads must be >= 1 (or None for torch's count), got {threads}")
        lib = native_library(SOURCE)
        self._fn = lib.kvsieve_decode_layer
        self._fn.argtypes, self._fn.restype = [ctypes.POINTER(_Args)], ctypes.c_int
        num_blocks, hkv, bs, d = k.shape
        self.program, self.num_kv_heads, self.k, self.v = program, hkv, k, v
        a = _Args()
        sk, sv = k.stride(), v.stride()
        a.k, a.v, a.k_blk, a.k_head, a.k_tok, a.k_ch = k.data_ptr(), v.data_ptr(), sk[0], sk[1], sk[2], sk[3]
        a.v_blk, a.v_head, a.v_tok, a.num_blocks = sv[0], sv[1], sv[2], num_blocks
        a.kv_bf16, a.block_size, a.hkv, a.D, a.G = int(k.dtype == torch.bfloat16), bs, hkv, d, num_q_heads // hkv
        a.sm_scale, a.threads = sm_scale, threads or 0
        p = program
        a.kind, a.mode, a.unit, a.units = KINDS[p.kind], MODES[p.mode], p.unit, p.units
        a.num_sink, a.init_units, a.local_units = p.num_sink, p.init_units, p.local_units
        if p.pool is not None:
            a.pool, a.pool_bf16, a.pool_sub, a.page_size = (p.pool.data_ptr(), int(p.pool.dtype == torch.bfloat16),
                                                            p.pool.shape[2], p.page_size)
        if p.index_keys is not None:
            a.ik, a.ik_bf16, a.id = p.index_keys.data_ptr(), int(p.index_keys.dtype == torch.bfloat16), p.index_keys.shape[-1]
        self._args = a
        self._ref = ctypes.byref(a)

    def run(self, table: np.ndarray, kv_lens: np.ndarray, q: torch.Tensor, out: torch.Tensor,
            index: IndexerStep | None = None) -> np.ndarray:
        """The step's ``N`` decode rows: ``table [N, W]`` int32 (rows may be strided, entries
        contiguous) their cache blocks, ``kv_lens [N]`` int32 contiguous their lengths (each row's
        token included, its K/V already in the cache); ``q [N, Hq, D]`` and ``out [N, Hq, D]`` (bf16 or
        fp32, heads contiguous, rows any stride); ``index``: the ``indexer`` program's step inputs.
        Writes ``out`` (and the selector's per-block state for this token) and returns ``attended
        [N, Hkv]`` int64, the positions each (row, KV head) read."""
        a, n = self._args, q.shape[0]
        if q.stride(2) != 1 or q.stride(1) != q.shape[2] or out.stride(2) != 1 or out.stride(1) != out.shape[2]:
            raise ValueError("kvsieve_decode_layer: q and out need contiguous heads ([N, Hq, D] rows of Hq * D)")
        attended = np.empty((n, self.num_kv_heads), dtype=np.int64)
        a.n_rows, a.table, a.table_stride, a.table_width = n, table.ctypes.data, table.strides[0] // 4, table.shape[1]
        a.kv_lens, a.attended = kv_lens.ctypes.data, attended.ctypes.data
        a.q, a.q_stride, a.q_bf16 = q.data_ptr(), q.stride(0), int(q.dtype == torch.bfloat16)
        a.out, a.out_stride, a.out_bf16 = out.data_ptr(), out.stride(0), int(out.dtype == torch.bfloat16)
        if index is not None:
            a.iq, a.iw, a.ik_new, a.ih = index.q.data_ptr(), index.weights.data_ptr(), index.keys.data_ptr(), index.q.shape[1]
        rc = self._fn(self._ref)
        if rc != 0:
            raise ValueError(f"kvsieve_decode_layer ({self.program.kind}): {_ERRORS.get(rc, f'code {rc}')}")
        return attended
