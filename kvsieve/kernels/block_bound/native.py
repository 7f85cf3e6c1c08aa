"""block_select's selection by Quest's bound for many rows in one native call: the C kernel of
``block_bound.c`` behind ctypes, beside its plain-PyTorch twin (:mod:`.naive`).
:func:`~kvsieve.selectors.block_select.selector.block_select_summary` calls it on the CPU for the rows
it selects (a prompt's rows; the rows of any step the one-call decode does not take).

Inputs: ``bounds [B, U, Hkv, 2 * D]`` fp32, per request and block the element-wise min then max of
the block's keys (blocks wholly before a row's own are read from it); ``own [n, Hkv, 2 * D]`` fp32,
each row's own block summarized over its positions up to the row; ``q [n, Hkv * G, D]`` (any float
dtype; taken as fp32); ``req [n]`` (row ``n``'s request in ``bounds``) and ``lens [n]`` (its visible
positions, >= 1) integer tensors; ``block_size``, ``k``, ``init_units``, ``local_units``,
``sm_scale``. Result: int32 ``[n, Hkv, k]``, per row and KV head the ``k`` blocks of the highest
score (the group's largest bound times ``sm_scale``; the first ``init_units`` and the last
``local_units`` visible blocks ``+inf``), ties to the lower block, ascending; every visible block
when there are no more than ``k``; ``-1`` after.

The kernel takes the summaries channel-major (``[B, Hkv, 2 * D, U']``, ``U'`` rounded up to 32: the
one transpose this wrapper makes), so sixteen blocks' bounds are one vector of sums, each over the
channels in order; the scores differ from a GEMM's (the torch path's ``einsum``) in the last bits, so
where two blocks' bounds tie to those bits either may be taken.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F

from ..common.native import native_library

__all__ = ["SOURCE", "block_bound_topk_native", "supports_block_bound"]

SOURCE = Path(__file__).with_name("block_bound.c")
MAX_D, MAX_G, UNIT_TILE = 256, 16, 32  # as in vec_math.h / block_bound.c
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_ARGTYPES = [_P, _I64, _P, _P, _P, _P, _I64, _I, _I, _I, _I64, _I64, _I64, _I64, _F, _P]


def supports_block_bound(q: torch.Tensor, num_kv_heads: int) -> bool:
    """Whether the kernel takes these queries ``[n, Hq, D]`` (its library may still be unavailable):
    on the CPU, ``D <= 256``, a query group of at most 16."""
    return (q.device.type == "cpu" and q.dim() == 3 and q.shape[2] <= MAX_D and q.shape[1] % num_kv_heads == 0
            and q.shape[1] // num_kv_heads <= MAX_G)


def block_bound_topk_native(bounds: torch.Tensor, own: torch.Tensor, q: torch.Tensor, req: torch.Tensor,
                            lens: torch.Tensor, *, block_size: int, k: int, init_units: int, local_units: int,
                            sm_scale: float) -> torch.Tensor:
    """int32 ``[n, Hkv, k]`` (module docstring); raises ``NativeUnavailable`` when the library is not
    there. The caller has checked :func:`supports_block_bound`."""
    fn = native_library(SOURCE).kvsieve_block_bound_topk
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    b, u, hkv, d2 = bounds.shape
    if own.shape[1:] != (hkv, d2) or d2 != 2 * q.shape[-1] or len(lens) and int(lens.max()) > u * block_size:
        raise ValueError(f"block_bound_topk: bounds {list(bounds.shape)}, own {list(own.shape)} and q "
                         f"{list(q.shape)} disagree, or a row sees past the {u} blocks of bounds")
    if len(req) != len(lens) or len(req) and not 0 <= int(req.min()) <= int(req.max()) < b:
        raise ValueError(f"block_bound_topk: req must give each of the {len(lens)} rows a request in 0 .. {b - 1} "
                         f"of bounds, got {len(req)} entries" + (f" in {int(req.min())} .. {int(req.max())}" if len(req) else ""))
    units = -(-max(u, 1) // UNIT_TILE) * UNIT_TILE
    bt = F.pad(bounds.to(torch.float32).permute(0, 2, 3, 1), (0, units - u)).contiguous()  # [B, Hkv, 2D, U']
    ownf, qf = own.to(torch.float32).contiguous(), q.to(torch.float32).contiguous()
    rq, ln = (x.to(device="cpu", dtype=torch.int32).contiguous() for x in (req, lens))
    n, hq, d = qf.shape
    out = torch.empty(n, hkv, k, dtype=torch.int32)
    rc = fn(bt.data_ptr(), units, ownf.data_ptr(), qf.data_ptr(), rq.data_ptr(), ln.data_ptr(), n, hkv, hq // hkv, d,
            block_size, k, init_units, local_units, sm_scale, out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"kvsieve_block_bound_topk returned {rc} (D={d}, G={hq // hkv}, units={u}, "
                           f"block_size={block_size}, k={k})")
    return out
