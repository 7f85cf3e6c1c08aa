"""Compile-only checks (no GPU): every CuTe kernel variant compiles for sm_90a and sm_100a,
uses the intended MMA instructions, does not spill, and fits shared memory."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvsieve.kernels.common.cute import SMEM_LIMIT

KINDS = ("mla", "mla_fp8", "gqa")
ARCHS = ("sm90", "sm100")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", KINDS)
def test_mma_instructions(compiled_variants, kind, arch):
    r = compiled_variants[(kind, arch)]
    ptx = Path(r.ptx_path).read_text()
    if arch == "sm90":
        assert ".target sm_90a" in ptx
        assert "wgmma.mma_async" in ptx and "tcgen05.mma" not in ptx
        # QK^T (N = BN = 64) and PV (N = value tile) both on wgmma
        assert any("m64n64k16" in k for k in r.mma_instructions)
        assert any(f"m64n{min(256, 512 if 'mla' in kind else 128)}k16" in k
                   for k in r.mma_instructions)
    else:
        assert ".target sm_100a" in ptx
        assert "tcgen05.mma" in ptx and "wgmma" not in ptx
        for op in ("tcgen05.alloc", "tcgen05.ld", "tcgen05.st", "tcgen05.commit",
                   "tcgen05.dealloc"):
            assert op in ptx, op
    assert "mma.sync" not in ptx  # no fallback to the warp-level MMA
    # exactly one MMA per k-step: QK^T over d_qk (576 or 128) + PV over the BN-row tile
    bn = 64 if arch == "sm90" else 32
    assert r.mma_count == (576 if "mla" in kind else 128) // 16 + bn // 16, r.mma_instructions


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", KINDS)
def test_no_spills_and_smem_fits(compiled_variants, kind, arch):
    r = compiled_variants[(kind, arch)]
    assert 0 < r.registers <= 255
    assert r.local_bytes == 0 and r.stack_bytes == 0, (r.local_bytes, r.stack_bytes)
    assert not r.spills
    assert r.dynamic_smem <= SMEM_LIMIT


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_variant_dequantizes_in_kernel(compiled_variants, arch):
    fp8 = Path(compiled_variants[("mla_fp8", arch)].ptx_path).read_text()
    bf16 = Path(compiled_variants[("mla", arch)].ptx_path).read_text()
    assert "e4m3" in fp8 and "e4m3" not in bf16
