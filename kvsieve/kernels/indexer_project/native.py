"""The C kernel of :mod:`kvsieve.kernels.indexer_project` (``indexer_project.c``) behind ctypes."""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..common.native import native_library

__all__ = ["CHUNK", "MAX_TOKENS", "SOURCE", "IndexerProjectCall", "indexer_project_native", "pack_weight",
           "supports_native"]

SOURCE = Path(__file__).with_name("indexer_project.c")
MAX_TOKENS = 64  # as in indexer_project.c
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
CHUNK = 32  # as in indexer_project.c: the outputs a chunk of the packed weight holds
_ARGTYPES = [_P, _I, _I64, _I, _I, _P, _I, _P, _P, _F, _P, _P, _I, _I, _I, _F, _P, _P, _P, _I, _I]


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
    return _hidden_taken(hidden) and _fp32_cpu(packed, *others)


def _hidden_taken(hidden: torch.Tensor) -> bool:
    """A step's hidden state the kernel reads: on the CPU, fp32 or bf16, channels contiguous, at most
    ``MAX_TOKENS`` rows."""
    return (hidden.device.type == "cpu" and hidden.dim() == 2 and hidden.dtype in (torch.float32, torch.bfloat16)
            and hidden.stride(1) == 1 and hidden.shape[0] <= MAX_TOKENS)


def _fp32_cpu(*tensors: torch.Tensor | None) -> bool:
    """Every tensor given (``None`` skipped) fp32, contiguous, on the CPU."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
               for t in tensors if t is not None)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _kernel() -> ctypes._CFuncPtr:
    """The C function, its types set once (ctypes keeps the object per library); raises
    ``NativeUnavailable`` as :func:`native_library` does (``KVSIEVE_NATIVE`` read every call)."""
    fn = native_library(SOURCE).kvsieve_indexer_project
    if fn.argtypes is None:
        fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    return fn


class IndexerProjectCall:
    """:func:`indexer_project_native` bound to one layer: its ``packed`` weight (:func:`pack_weight`), the
    key's norm (``norm_weight``/``norm_bias [D]`` fp32, or both ``None``) and geometry, their shapes
    checked once (``ValueError`` naming the tensor), so that a step checks and passes only its own
    tensors: :meth:`takes`, then :meth:`run`. The bound tensors are read in place at every call."""

    def __init__(self, packed: torch.Tensor, norm_weight: torch.Tensor | None, norm_bias: torch.Tensor | None,
                 eps: float, n_heads: int, head_dim: int, rope_dim: int, w_scale: float) -> None:
        self.packed, self.norm_weight, self.norm_bias = packed, norm_weight, norm_bias
        self.eps, self.n_heads, self.head_dim, self.rope_dim, self.w_scale = eps, n_heads, head_dim, rope_dim, w_scale
        n = n_heads * head_dim + n_heads + head_dim
        if (packed.dim() != 3 or packed.shape[2] != CHUNK or packed.shape[0] * CHUNK < n
                or any(v is not None and v.shape != (head_dim,) for v in (norm_weight, norm_bias))):
            raise ValueError(self._misfit(None, None, None))
        self.hidden_size = packed.shape[1]
        self._bound_taken = _fp32_cpu(packed, norm_weight, norm_bias)

    def _misfit(self, hidden: torch.Tensor | None, cos: torch.Tensor | None, sin: torch.Tensor | None) -> str:
        """The message naming every tensor whose shape does not fit the others."""
        h, d, r, packed = self.n_heads, self.head_dim, self.rope_dim, self.packed
        n, wrong = h * d + h + d, []
        width = hidden.shape[1] if hidden is not None else packed.shape[1] if packed.dim() == 3 else None
        if packed.dim() != 3 or packed.shape[1:] != (width, CHUNK) or packed.shape[0] * CHUNK < n:
            wrong.append(f"packed {tuple(packed.shape)} (want [>= {-(-n // CHUNK)}, {width}, {CHUNK}])")
        for name, v in (("norm_weight", self.norm_weight), ("norm_bias", self.norm_bias)):
            if v is not None and v.shape != (d,):
                wrong.append(f"{name} {tuple(v.shape)} (want [{d}])")
        if hidden is not None:
            for name, v in (("cos", cos), ("sin", sin)):
                if r and (v is None or v.shape != (hidden.shape[0], r)):
                    wrong.append(f"{name} {None if v is None else tuple(v.shape)} (want [{hidden.shape[0]}, {r}])")
        shape = "" if hidden is None else f", hidden {tuple(hidden.shape)}"
        return f"indexer_project_native: {h} heads x {d}, rope_dim {r}{shape}: " + "; ".join(wrong)

    def takes(self, hidden: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> bool:
        """:func:`supports_native` for this layer's bound tensors and a step's ``hidden``, ``cos``, ``sin``."""
        return self._bound_taken and _hidden_taken(hidden) and _fp32_cpu(cos, sin)

    def run(self, hidden: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, *,
            round_q_bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`indexer_project_native` of a step's ``hidden [T, hidden_size]`` and ``cos``/``sin
        [T, rope_dim]`` (tensors :meth:`takes` takes)."""
        t, h, d, r = hidden.shape[0], self.n_heads, self.head_dim, self.rope_dim
        if hidden.shape[1] != self.hidden_size or (r and (cos is None or sin is None or cos.shape != (t, r)
                                                           or sin.shape != (t, r))):
            raise ValueError(self._misfit(hidden, cos, sin))
        fn = _kernel()
        q, k, w = (torch.empty(t, m, dtype=torch.float32) for m in (h * d, d, h))
        rc = fn(hidden.data_ptr(), int(hidden.dtype == torch.bfloat16), hidden.stride(0), t, self.hidden_size,
                self.packed.data_ptr(), self.packed.shape[0], _ptr(self.norm_weight), _ptr(self.norm_bias), self.eps,
                _ptr(cos), _ptr(sin), h, d, r, self.w_scale, q.data_ptr(), k.data_ptr(), w.data_ptr(),
                int(round_q_bf16), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"kvsieve_indexer_project returned {rc} (hidden {tuple(hidden.shape)}, {h} heads x {d})")
        return q.view(t, h, d), k, w


def indexer_project_native(hidden: torch.Tensor, packed: torch.Tensor, norm_weight: torch.Tensor | None,
                           norm_bias: torch.Tensor | None, eps: float, cos: torch.Tensor | None,
                           sin: torch.Tensor | None, n_heads: int, head_dim: int, rope_dim: int, w_scale: float,
                           round_q_bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As :func:`~.naive.indexer_project_naive` with the stacked weight in the kernel's layout
    (``packed``: :func:`pack_weight`), for tensors :func:`supports_native` takes; ``round_q_bf16``: q
    rounded to bf16's precision (``q.to(torch.bfloat16).float()``, still fp32), as a bf16 key pool is
    scored. Runs on torch's OpenMP thread count (each output is one thread's sum: the values do not
    depend on it). Raises ``NativeUnavailable`` when the library is not there (``KVSIEVE_NATIVE=0``
    included, read every call), ``ValueError`` for shapes that do not fit together (nothing is read or
    written). One layer's steps: :class:`IndexerProjectCall`."""
    call = IndexerProjectCall(packed, norm_weight, norm_bias, eps, n_heads, head_dim, rope_dim, w_scale)
    return call.run(hidden, cos, sin, round_q_bf16=round_q_bf16)
