"""CuTe-DSL GVR top-k (``kvsieve.kernels.topk.cute``).

CPU (always): every variant (k 512/1024/2048) compiles for sm_90a and sm_100a, with no spills or
local memory and shared memory within 227 KiB, and the PTX holds the shared-memory histogram
atomics and warp scans; the module imports without ``cutlass``, validates its arguments, and
``auto`` dispatch on CPU still picks ``torch``; the PyTorch mirror of the kernel's algorithm
(``mirror.py``) equals the ``radix`` reference on lengths 1..131072, ties, ``-inf`` and ``-0.0``.

GPU (``sm90``/``sm100`` markers, skipped without an SM90/SM100/SM103 device): the kernel's
positions equal the reference's and the Triton ``gvr`` kernel's, and its values equal
``torch.topk``'s multiset.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvsieve.kernels.common.cute import SMEM_LIMIT, cute_available
from kvsieve.kernels.topk import naive, plan
from kvsieve.kernels.topk.cute import host as cute_topk
from kvsieve.kernels.topk.cute.mirror import gvr_topk_mirror
from kvsieve.kernels.topk.cute.params import capacity_for, smem_bytes

KS = (512, 1024, 2048)
ARCHS = ("sm90", "sm100")
LENGTHS = (1, 300, 511, 512, 513, 1000, 2047, 2048, 2049, 4097, 9295, 32768, 131072)


def _rows(n: int, seed: int) -> torch.Tensor:
    """Four rows of width ``n``: random normal; heavy ties with -inf and -0.0; all equal; a
    row whose top values all sit at its end (sample-unfriendly)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(4, n, generator=g)
    s[1] = torch.randint(-3, 4, (n,), generator=g).float()
    s[1, torch.randperm(n, generator=g)[: n // 3]] = float("-inf")
    s[1, ::7] = -0.0
    s[2] = 0.5
    s[3] = torch.arange(n, dtype=torch.float32) / n
    s[3, -(n // 50 + 1):] = 3.0
    return s


# ---------------------------------------------------------------- compile only (CPU)

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("k", KS)
def test_compiles_without_spills(compiled_topk, k, arch):
    r = compiled_topk[(k, arch)]
    ptx = Path(r.ptx_path).read_text()
    assert f".target {'sm_90a' if arch == 'sm90' else 'sm_100a'}" in ptx
    assert Path(r.cubin_path).stat().st_size > 0
    assert 0 < r.registers <= 255
    assert r.stack_bytes == 0 and r.local_bytes == 0 and not r.spills, (r.stack_bytes, r.local_bytes)
    assert r.dynamic_smem == smem_bytes(k) <= SMEM_LIMIT
    assert r.mma_count == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_ptx_evidence(compiled_topk, arch):
    r = compiled_topk[(2048, arch)]
    ptx = Path(r.ptx_path).read_text()
    assert ".reqntid 512, 1, 1" in ptx  # one 512-thread CTA per row
    assert "atom.shared.add" in ptx  # shared-memory histograms
    assert "shfl.sync.up" in ptx and "shfl.sync.down" in ptx  # block scan + crossing-bin scan
    assert "bar.sync" in ptx or "barrier.sync" in ptx
    assert ".extern .shared" in ptx  # dynamic smem: sample, histogram, candidate scratch
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert "div.s64" not in ptx and "div.u64" not in ptx  # shift binning, no 64-bit division
    assert "wgmma" not in ptx and "tcgen05" not in ptx and "mma.sync" not in ptx


def test_report_lists_topk_rows():
    from kvsieve.kernels.aot.cute_report import table, topk_variants

    specs = topk_variants()
    assert {(s["k"], s["arch"]) for s in specs} == {(k, a) for k in KS for a in ARCHS}
    from kvsieve.kernels.aot.cute_compile import CompileReport

    fake = CompileReport("topk_gvr_k512_sm90", "sm90", 40, 0, 0, smem_bytes(512), {},
                         {"atom.shared.add": 20}, 1.0, "", "")
    assert "| topk_gvr_k512 | sm90 | 40 | 0 | 0 | 70896 | none (20 x `atom.shared.add`)" in table([fake])


# ---------------------------------------------------------------- host side and dispatch (CPU)

def test_import_without_cutlass_and_auto_on_cpu():
    code = (
        "import sys; sys.modules['cutlass'] = None\n"  # any import of cutlass now fails
        "import kvsieve.kernels.topk.cute as m\n"
        "from kvsieve.kernels.topk.cute import host, mirror\n"
        "from kvsieve.kernels.topk import plan\n"
        "d = plan.choose_topk_engine('auto', device='cpu', index_topk=2048)\n"
        "assert d.engine == 'torch', d\n"
        "print('ok')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


def test_dispatch_sees_the_module():
    ok, _ = cute_available()
    assert plan.cute_dsl_available() == ok  # the kernel module ships now
    assert plan.choose_topk_engine("auto", device="cpu", index_topk=2048).engine == "torch"
    d = plan.choose_topk_engine("auto", device="cuda", index_topk=1024, sm=100,
                                    cute_available=True)
    assert d.engine == "cute_gvr"


def test_validation_names_the_argument():
    s = torch.zeros(2, 4096)
    lens = torch.full((2,), 4096, dtype=torch.int32)
    with pytest.raises(ValueError, match="^k:"):
        cute_topk.gvr_topk(s, lens, 256)
    with pytest.raises(ValueError, match="^scores:"):
        cute_topk.gvr_topk(s.double(), lens, 512)
    with pytest.raises(ValueError, match="^lengths:"):
        cute_topk.gvr_topk(s, lens.long(), 512)
    with pytest.raises(ValueError, match="^lengths:"):
        cute_topk.gvr_topk(s, lens[:1], 512)
    with pytest.raises(ValueError, match="^out:"):
        cute_topk.gvr_topk(s, lens, 512, torch.empty(2, 512, dtype=torch.int64))
    with pytest.raises(ValueError, match="^out:"):
        cute_topk.gvr_topk(s, lens, 512, torch.empty(2, 1024, dtype=torch.int32))
    with pytest.raises(ValueError, match="^stats:"):
        cute_topk.gvr_topk(s, lens, 512, stats=torch.empty(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="^scores: .*CUDA"):  # CPU tensors: refused, not computed
        cute_topk.gvr_topk(s, lens, 512)


# ---------------------------------------------------------------- the algorithm (CPU mirror)

@pytest.mark.parametrize("k", KS)
def test_mirror_equals_reference(k):
    for i, n in enumerate(LENGTHS):
        s = _rows(n, seed=i)
        lens = torch.tensor([n, n, n, max(0, n - 5)], dtype=torch.int32)
        got, fb = gvr_topk_mirror(s, lens, k)
        ref = naive.radix_topk(s, lens, k)
        assert torch.equal(got, ref), (n, k)
        if n > capacity_for(k):
            assert fb[2] == 1  # all-equal row: the in-kernel fallback, still exact
        if n > 4 * k:
            assert fb[0] == 0  # random row: the guess holds


def test_mirror_guess_rarely_falls_back():
    g = torch.Generator().manual_seed(7)
    s = torch.randn(16, 131072, generator=g)
    lens = torch.full((16,), 131072, dtype=torch.int32)
    for k in KS:
        got, fb = gvr_topk_mirror(s, lens, k)
        assert int(fb.sum()) == 0
        assert torch.equal(got, naive.radix_topk(s, lens, k))


# ---------------------------------------------------------------- GPU

def _device_ok() -> bool:
    if not torch.cuda.is_available() or not cute_available()[0]:
        return False
    return torch.cuda.get_device_capability() in cute_topk.GPU_ARCH


needs_gpu = pytest.mark.skipif(not _device_ok(), reason="needs an SM90/SM100/SM103 GPU and "
                                                     "nvidia-cutlass-dsl")


def _values_match_torch(s, lens, got, k):
    for r in range(s.shape[0]):
        n = int(lens[r])
        m = min(n, k)
        sel = got[r, :m].long()
        assert bool((got[r, m:] == -1).all()) and bool((sel >= 0).all())
        assert bool((sel[1:] > sel[:-1]).all())  # ascending, distinct
        want = torch.topk(s[r, :n], m).values.sort().values
        assert torch.equal(s[r, sel].sort().values, want)


@pytest.mark.sm90
@pytest.mark.sm100
@needs_gpu
@pytest.mark.parametrize("k", KS)
def test_gpu_matches_reference_and_triton(k):
    from kvsieve.kernels.topk import triton as triton_topk

    for i, n in enumerate(LENGTHS):
        s = _rows(n, seed=i)
        lens = torch.tensor([n, n, n, max(0, n - 5)], dtype=torch.int32)
        ref = naive.radix_topk(s, lens, k)
        sd, ld = s.cuda(), lens.cuda()
        stats = torch.zeros(4, dtype=torch.int32, device="cuda")
        got = cute_topk.gvr_topk(sd, ld, k, stats=stats).cpu()
        assert torch.equal(got, ref), (n, k)
        _values_match_torch(s, lens, got, k)
        ws = torch.empty(2, 4, 4 * k, dtype=torch.int32, device="cuda")
        tri = triton_topk.gvr_topk(sd, ld, k, 4 * k, workspace=ws, block=1024, num_warps=8).cpu()
        assert torch.equal(got, tri), (n, k)
        if n > capacity_for(k):
            assert int(stats[2]) == 1


@pytest.mark.sm90
@pytest.mark.sm100
@needs_gpu
def test_gpu_strided_rows_out_view_and_dispatch():
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(5, 70000, generator=g)
    s = wide[:, 1:65537]  # row stride 70000, unaligned start
    lens = torch.tensor([65536, 0, 1, 40000, 2049], dtype=torch.int32)
    ref = naive.radix_topk(s.contiguous(), lens, 1024)
    out = torch.full((8, 1024), 7, dtype=torch.int32, device="cuda")
    got = cute_topk.gvr_topk(s.cuda(), lens.cuda(), 1024, out[:5])
    assert got.data_ptr() == out.data_ptr() and torch.equal(got.cpu(), ref)
    assert bool((out[5:] == 7).all())
    d = plan.choose_topk_engine("auto", device="cuda", index_topk=1024)
    assert d.engine == "cute_gvr", d.reason
    ws = plan.TopKWorkspace(d, max_rows=8, device="cuda")
    assert torch.equal(plan.run_topk(ws, s.cuda(), lens.cuda()).cpu(), ref)

