"""Argument validation shared by the kernels (Triton, CuTe host) and their references (shape/dtype only:
nothing here syncs with the device; value checks belong to ``SparseRuntimeParams.validate``)."""
from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_tensor(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...] | None = None,
                 device: torch.device | None = None) -> torch.Tensor:
    """Raise ValueError unless ``t`` is a tensor with ``ndim`` dims, an allowed dtype and device."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype in {dtypes}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    return t


def check_shape(name: str, t: torch.Tensor, shape: tuple[int | None, ...]) -> None:
    """Raise ValueError unless ``t.shape`` matches ``shape`` (``None`` = any size)."""
    ok = len(shape) == t.dim() and all(s is None or s == d for s, d in zip(shape, t.shape))
    if not ok:
        want = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")


def check_positive_int(name: str, value: object) -> int:
    """Raise ValueError unless ``value`` is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return value


def resolve_scale(sm_scale: float | None, head_dim: int) -> float:
    """``sm_scale`` or ``1/sqrt(head_dim)``; raises on a non-finite or non-positive value."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale: expected a finite float > 0 or None, got {sm_scale!r}")
    return float(sm_scale)


def check_threshold(threshold_scale_factor: float) -> float:
    """Skip-softmax factor: finite and >= 0 (0 = off)."""
    f = threshold_scale_factor
    if not isinstance(f, (int, float)) or not math.isfinite(f) or f < 0:
        raise ValueError(f"threshold_scale_factor: expected a finite float >= 0, got {f!r}")
    return float(f)


def check_stats(stats: torch.Tensor | None, device: torch.device) -> None:
    """``stats`` is None or an int32/int64 tensor of shape [2] on ``device``."""
    if stats is None:
        return
    check_tensor("stats", stats, 1, (torch.int32, torch.int64), device)
    check_shape("stats", stats, (2,))


def check_query_meta(block_table: torch.Tensor, token_to_req: torch.Tensor,
                     kv_lens: torch.Tensor, num_tokens: int, device: torch.device) -> None:
    """Block table [batch, max_blocks] int32, token_to_req/kv_lens [num_tokens] int32."""
    check_tensor("block_table", block_table, 2, (torch.int32,), device)
    check_tensor("token_to_req", token_to_req, 1, (torch.int32,), device)
    check_tensor("kv_lens", kv_lens, 1, (torch.int32,), device)
    check_shape("token_to_req", token_to_req, (num_tokens,))
    check_shape("kv_lens", kv_lens, (num_tokens,))
    if block_table.stride(1) != 1:
        raise ValueError("block_table: expected a unit stride along max_blocks_per_seq")


def check_selection(indices: torch.Tensor | None, offsets: torch.Tensor | None, num_tokens: int,
                    num_kv_heads: int, block_size: int, device: torch.device) -> None:
    """Sparse selection ``indices [num_kv_heads, total]`` / ``offsets [num_tokens + 1]`` int32."""
    check_positive_int("block_size", block_size)
    if (indices is None) != (offsets is None):
        raise ValueError("indices/offsets: expected both tensors or both None (dense)")
    if indices is None:
        return
    check_tensor("indices", indices, 2, (torch.int32,), device)
    check_tensor("offsets", offsets, 1, (torch.int32,), device)
    check_shape("indices", indices, (num_kv_heads, None))
    check_shape("offsets", offsets, (num_tokens + 1,))
    if indices.shape[1] > 0 and indices.stride(1) != 1:
        raise ValueError("indices: expected a unit stride along total_selected")


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(0, (n - 1).bit_length())


def split_head_dim(d: int) -> tuple[int, int]:
    """Split a K head dim into a power-of-two main part and a remainder (576 -> 512 + 64)."""
    main = 1 << (d.bit_length() - 1)
    return main, d - main
