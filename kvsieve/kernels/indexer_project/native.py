"""The C kernel of :mod:`kvsieve.kernels.indexer_project` (``indexer_project.c``) behind ctypes."""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..common.native import native_library

__all__ = ["CHUNK", "MAX_TOKENS", "SOURCE", "indexer_project_native", "pack_weight", "supports_native"]

SOURCE = Path(__file__).with_name("indexer_project.c")
MAX_TOKENS = 64  # as in indexer_project.c
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
CHUNK = 32  # as in indexer_project.c: the outputs a chunk of the packed weight holds
_ARGTYPES = [_P, _I, _I64, _I, _I, _P, _I, _P, _P, _F, _P, _P, _I, _I, _I, _F, _P, _P, _P, _I]


def pack_weight(stacked: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of ``stacked [N, hidden_size]``: ``[chunks, hidden_size, CHUNK]`` (same dtype
    and device, ``chunks = ceil(N / CHUNK)``), ``packed[n // CHUNK, :, n % CHUNK]`` the stacked weight's
    row ``n``, zero past its last row: each chunk of outputs reads one contiguous stretch."""
    n, k = stacked.shape
    chunks = -(-n // CHUNK)
    padded = torch.zeros(chunks * CHUNK, k, dtype=stacked.dtype, device=stacked.device)
    padded[:n] = stacked
    return padded.view(chunks, CHUNK, k).transpose(1, 2).contiguous()


def supports_native(hidden: torch.Tensor, packed: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether the native kernel takes these tensors (its library may still be unavailable): on the
    CPU, ``hidden`` fp32 or bf16 with contiguous channels and at most ``MAX_TOKENS`` rows, ``packed``
    (:func:`pack_weight`) and ``others`` (the norm's weight and bias, cos and sin, those given) fp32
    contiguous."""
    fp32 = [packed, *(t for t in others if t is not None)]
    return (hidden.device.type == "cpu" and hidden.dim() == 2 and hidden.dtype in (torch.float32, torch.bfloat16)
            and hidden.stride(1) == 1 and hidden.shape[0] <= MAX_TOKENS
            and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in fp32))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _refuse(hidden: torch.Tensor, packed: torch.Tensor, norm_weight: torch.Tensor | None,
            norm_bias: torch.Tensor | None, cos: torch.Tensor | None, sin: torch.Tensor | None, h: int, d: int,
            rope_dim: int) -> None:
    """Raise the ``ValueError`` naming every tensor whose shape does not fit the others."""
    t, n = hidden.shape[0], h * d + h + d
    wrong = []
    if packed.dim() != 3 or packed.shape[1:] != (hidden.shape[1], CHUNK) or packed.shape[0] * CHUNK < n:
        wrong.append(f"packed {tuple(packed.shape)} (want [>= {-(-n // CHUNK)}, {hidden.shape[1]}, {CHUNK}])")
    for name, v in (("norm_weight", norm_weight), ("norm_bias", norm_bias)):
        if v is not None and v.shape != (d,):
            wrong.append(f"{name} {tuple(v.shape)} (want [{d}])")
    for name, v in (("cos", cos), ("sin", sin)):
        if rope_dim and (v is None or v.shape != (t, rope_dim)):
            wrong.append(f"{name} {None if v is None else tuple(v.shape)} (want [{t}, {rope_dim}])")
    raise ValueError(f"indexer_project_native: {h} heads x {d}, rope_dim {rope_dim}, hidden "
                     f"{tuple(hidden.shape)}: " + "; ".join(wrong))


def indexer_project_native(hidden: torch.Tensor, packed: torch.Tensor, norm_weight: torch.Tensor | None,
                           norm_bias: torch.Tensor | None, eps: float, cos: torch.Tensor | None,
                           sin: torch.Tensor | None, n_heads: int, head_dim: int, rope_dim: int, w_scale: float
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As :func:`~.naive.indexer_project_naive` with the stacked weight in the kernel's layout
    (``packed``: :func:`pack_weight`), for tensors :func:`supports_native` takes; runs on
    torch's OpenMP thread count (each output is one thread's sum: the values do not depend on it).
    Raises ``NativeUnavailable`` when the library is not there (``KVSIEVE_NATIVE=0`` included, read
    every call), ``ValueError`` for shapes that do not fit together (nothing is read or written)."""
    t, h, d = hidden.shape[0], n_heads, head_dim
    n = h * d + h + d
    ps = packed.shape
    fits = (len(ps) == 3 and ps[1] == hidden.shape[1] and ps[2] == CHUNK and ps[0] * CHUNK >= n
            and all(v is None or v.shape == (d,) for v in (norm_weight, norm_bias))
            and (not rope_dim or all(v is not None and v.shape == (t, rope_dim) for v in (cos, sin))))
    if not fits:
        _refuse(hidden, packed, norm_weight, norm_bias, cos, sin, h, d, rope_dim)
    fn = native_library(SOURCE).kvsieve_indexer_project  # ctypes keeps this object, and its types, per library
    if fn.argtypes is None:
        fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    q, k, w = (torch.empty(t, m, dtype=torch.float32) for m in (h * d, d, h))
    rc = fn(hidden.data_ptr(), int(hidden.dtype == torch.bfloat16), hidden.stride(0), t, hidden.shape[1],
            packed.data_ptr(), packed.shape[0], _ptr(norm_weight), _ptr(norm_bias), eps, _ptr(cos), _ptr(sin), h, d,
            rope_dim, w_scale, q.data_ptr(), k.data_ptr(), w.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"kvsieve_indexer_project returned {rc} (hidden {tuple(hidden.shape)}, "
                           f"{h} heads x {d})")
    return q.view(t, h, d), k, w
