"""Launch constants of the CuTe-DSL GVR top-k, importable without ``cutlass`` (the host, the
CPU mirror and the report read them; ``device.py`` builds the kernel from them)."""
from __future__ import annotations

THREADS = 512  # one CTA per row, 16 warps
WARPS = THREADS // 32
VEC = 4  # consecutive row entries per thread per chunk
CHUNK = THREADS * VEC
SAMPLE = 1024  # guess sample (same as the Triton kernel's GVR_SAMPLE)
BINS = 256  # verify histogram bins (same as GVR_BINS)
MIN_CAPACITY = 8192  # shared-memory candidate scratch entries at least


def capacity_for(k: int) -> int:
    """Shared-memory candidate scratch entries for top-``k``: ``max(4k, 8192)`` (64 KiB of keys +
    positions for every supported k)."""
    return max(4 * k, MIN_CAPACITY)


def smem_bytes(k: int) -> int:
    """Dynamic shared memory of the top-``k`` kernel: scratch keys + positions, the sample, the
    histogram, the scan's double-buffered per-warp totals, broadcast scalars, plus the
    allocator's alignment slack."""
    return 8 * capacity_for(k) + 4 * SAMPLE + 4 * BINS + 4 * 2 * WARPS + 4 * 8 + 5 * 16
