"""Launch-configuration heuristics for the kvsieve Triton kernels, chosen in one place.

Every tile size, warp count, pipeline depth and split-K bound used by a Triton kernel of kvsieve
comes from the tables below; call sites never pick numbers. The architecture key is one of

* ``"interpreter"``: ``TRITON_INTERPRET=1`` or CPU tensors. Programs run one after another in
  Python, so tiles are large (fewer loop trips) and split-K is off (it only adds programs).
* ``"sm90"``: Hopper (H100/H200, 132 SMs, 227 KiB shared memory per block).
* ``"sm100"``: Blackwell datacenter (B200, 148 SMs, 227 KiB shared memory per block).
* ``"other"``: any other CUDA GPU (Ampere/Ada/consumer Blackwell): conservative tiles.

Rationale of the numbers (verified by ``python -m kvsieve.kernels.aot.triton_report``: 0 spills,
shared memory within the 227 KiB limit):

* GQA decode gathers one KV tile of ``block_n`` tokens per loop trip; the GQA group is the M
  side of the MMA, padded to 16 rows, so these programs use ``mma.sync`` (wgmma/tcgen05 need
  >= 64 rows). Throughput comes from many programs and deep cp.async pipelining
  (``num_stages``), not from the tensor cores: decode is bandwidth bound.
* MLA decode packs ``block_h`` query heads per program. sm100: 64 heads, 8 warps -> tcgen05
  (accumulator in TMEM), 0 spills. sm90: a 64-row wgmma tile keeps the [64, 512] fp32
  accumulator in registers and spills (>= 28 B at every block_n/warps/stages tried, 332 B at 16
  warps), so sm90 ships 32 heads per program (mma.sync, 0 spills); reaching wgmma there needs
  the V columns split over two warpgroup accumulators (FlashMLA style), not done.
* Dense prefill: 64-row query tiles reach wgmma/tcgen05; sm90 needs 8 warps to avoid spills.
* Split-K: used when the (token, kv head, head block) programs do not fill the GPU and each
  has many KV tiles; at least ``MIN_TILES_PER_SPLIT`` tiles per split so the merge is amortised.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch

ARCHS = ("interpreter", "sm90", "sm100", "other")
MIN_TILES_PER_SPLIT = 4


@dataclass(frozen=True)
class DecodeConfig:
    """Gather-attention (GQA decode, sparse prefill, MLA decode) launch parameters."""

    block_n: int  # KV tokens per loop trip
    block_h: int  # query heads per program (MLA); GQA uses the padded group instead
    num_warps: int
    num_stages: int
    max_splits: int  # upper bound of the split-K heuristic


@dataclass(frozen=True)
class PrefillConfig:
    """Dense tiled prefill launch parameters (query tile = block_m tokens x padded group)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# GQA decode, head_dim <= 128 (keys: arch). head_dim > 128 halves block_n (see gqa_decode_config).
GQA_DECODE: dict[str, DecodeConfig] = {
    "interpreter": DecodeConfig(block_n=64, block_h=16, num_warps=4, num_stages=1, max_splits=1),
    "sm90": DecodeConfig(block_n=64, block_h=16, num_warps=4, num_stages=3, max_splits=16),
    "sm100": DecodeConfig(block_n=64, block_h=16, num_warps=4, num_stages=3, max_splits=16),
    "other": DecodeConfig(block_n=32, block_h=16, num_warps=4, num_stages=2, max_splits=16),
}

# Absorbed MLA decode (kv_lora_rank 512 + rope 64).
MLA_DECODE: dict[str, DecodeConfig] = {
    "interpreter": DecodeConfig(block_n=64, block_h=16, num_warps=4, num_stages=1, max_splits=1),
    "sm90": DecodeConfig(block_n=32, block_h=32, num_warps=8, num_stages=2, max_splits=32),
    "sm100": DecodeConfig(block_n=32, block_h=64, num_warps=8, num_stages=2, max_splits=32),
    "other": DecodeConfig(block_n=16, block_h=16, num_warps=4, num_stages=2, max_splits=32),
}

# Dense tiled prefill, head_dim <= 128.
PREFILL: dict[str, PrefillConfig] = {
    "interpreter": PrefillConfig(block_m=16, block_n=64, num_warps=4, num_stages=1),
    "sm90": PrefillConfig(block_m=64, block_n=64, num_warps=8, num_stages=3),
    "sm100": PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3),
    "other": PrefillConfig(block_m=32, block_n=32, num_warps=4, num_stages=2),
}

MERGE_NUM_WARPS = 4
COMPACT_BLOCK_N = {"interpreter": 64, "sm90": 64, "sm100": 64, "other": 32}
NUM_SMS = {"interpreter": 1, "sm90": 132, "sm100": 148, "other": 80}


@lru_cache(maxsize=1)
def check_interpreter(triton_version: str, numpy_version: str) -> None:
    """Refuse the one known-broken interpreter stack: triton < 3.8 (3.6 seen failing, 3.8 and 3.9
    working) turns 1-element arrays into loop bounds with ``int()``, which numpy >= 2.4 refuses (a
    TypeError inside the interpreter at the first ``range()`` over a tensor). Compiled kernels on a
    GPU are unaffected."""
    tv, nv = (tuple(int(x) for x in v.split(".")[:2]) for v in (triton_version, numpy_version))
    if tv < (3, 8) and nv >= (2, 4):
        raise RuntimeError(f"TRITON_INTERPRET=1: triton {triton_version}'s interpreter fails with numpy "
                           f"{numpy_version} (numpy >= 2.4 refuses int() of 1-element arrays, which it uses "
                           f"for loop bounds); install numpy<2.4 or triton>=3.8")


def detect_arch(device: torch.device) -> str:
    """Return the launch-table key for tensors living on ``device``."""
    if os.environ.get("TRITON_INTERPRET") == "1" or device.type != "cuda":
        if os.environ.get("TRITON_INTERPRET") == "1":
            import numpy
            import triton
            check_interpreter(triton.__version__, numpy.__version__)
        return "interpreter"
    major, _ = torch.cuda.get_device_capability(device)
    return {9: "sm90", 10: "sm100"}.get(major, "other")


def _check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {ARCHS}, got {arch!r}")


def gqa_decode_config(arch: str, head_dim: int) -> DecodeConfig:
    """Config of the GQA gather-attention kernel for ``arch`` and the K/V head dim."""
    _check_arch(arch)
    cfg = GQA_DECODE[arch]
    if head_dim > 128 and arch != "interpreter":
        cfg = DecodeConfig(max(16, cfg.block_n // 2), cfg.block_h, cfg.num_warps,
                           max(1, cfg.num_stages - 1), cfg.max_splits)
    return cfg


def mla_decode_config(arch: str, num_heads: int) -> DecodeConfig:
    """Config of the MLA kernel; ``block_h`` never exceeds the (power-of-two padded) head count."""
    _check_arch(arch)
    cfg = MLA_DECODE[arch]
    padded = max(16, 1 << (num_heads - 1).bit_length())
    if cfg.block_h > padded:
        cfg = DecodeConfig(cfg.block_n, padded, cfg.num_warps, cfg.num_stages, cfg.max_splits)
    return cfg


def prefill_config(arch: str, head_dim: int, group: int) -> PrefillConfig:
    """Config of the dense tiled prefill; the query tile holds ``block_m // group`` tokens."""
    _check_arch(arch)
    cfg = PREFILL[arch]
    if head_dim > 128 and arch != "interpreter":
        cfg = PrefillConfig(cfg.block_m, max(16, cfg.block_n // 2), cfg.num_warps,
                            max(1, cfg.num_stages - 1))
    return cfg


def choose_num_splits(arch: str, num_programs: int, tiles_per_program: int,
                      max_splits: int) -> int:
    """Split-K factor from shapes only (no device sync, CUDA-graph safe).

    ``num_programs`` = tokens x kv heads x head blocks; ``tiles_per_program`` = an estimate of
    the KV tiles one program walks (selection length, or block-table capacity for dense).
    Returns 1 when the programs already fill ``2 x NUM_SMS`` or the work per program is short.
    """
    _check_arch(arch)
    if num_programs <= 0:
        raise ValueError(f"num_programs: expected > 0, got {num_programs}")
    target = 2 * NUM_SMS[arch]
    if num_programs >= target:
        return 1
    by_occupancy = -(-target // num_programs)
    by_work = max(1, tiles_per_program // MIN_TILES_PER_SPLIT)
    return max(1, min(max_splits, by_occupancy, by_work))
