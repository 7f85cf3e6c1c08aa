"""Compile-only driver of the CuTe-DSL kernels and the resource readers (no GPU needed).

Every kernel variant is compiled in a child process (``python -m kvsieve.kernels.aot.cute_compile
SPEC_JSON OUT_DIR``) with ``CUTE_DSL_KEEP=ptx,cubin`` and ``CUTE_DSL_DUMP_DIR`` set before
``cutlass`` is imported (the DSL reads them at start-up), with pointer arguments
(``cute.runtime.make_ptr``) and a fake stream. A spec is a gather-attention variant (``{"arch",
"kind": mla|mla_fp8|gqa, "d_qk", "d_v", "dv_tile", "group", "num_kv_heads", "block_n"}``) or a GVR
top-k one (``{"arch", "kind": "topk_gvr", "k"}``). What is trusted (reference/toolchain.md):

* registers / stack / local (spill) bytes: ``cuobjdump -res-usage`` on the DSL's own cubin
  (Triton's bundled ``cuobjdump``; no CUDA toolkit needed);
* dynamic shared memory: the byte count the kernel passes to ``launch(smem=...)``
  (``kernel.smem_size``), checked against the 227 KiB opt-in limit of sm_90/sm_100;
* MMA evidence: instruction counts grepped from the PTX; the top-k kernel adds its own PTX
  evidence (``TOPK_PTX_COUNTS``: shared-memory atomics, barriers, warp shuffles, 64-bit divisions).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from ..common.cute import ARCH_FLAGS

__all__ = ["CompileReport", "TOPK_PTX_COUNTS", "compile_and_collect", "compile_variant", "ptx_evidence",
           "res_usage", "triton_bin_dir", "variant_name"]

MMA_PATTERNS = {"sm90": r"wgmma\.mma_async[.a-z0-9]*", "sm100": r"tcgen05\.mma[.a-z0-9:_]*"}
TOPK_PTX_COUNTS = ("atom.shared.add", "red.shared.add", "bar.sync", "barrier.sync", "shfl.sync.up",
                   "shfl.sync.down", "ld.global", "st.global", "ld.shared", "st.shared", "div.s64",
                   "div.u64")


def variant_name(spec: dict) -> str:
    """The report name of a spec: ``topk_gvr_k<k>_<arch>`` or ``<kind>_<arch>``."""
    if spec["kind"] == "topk_gvr":
        return f"topk_gvr_k{spec['k']}_{spec['arch']}"
    return f"{spec['kind']}_{spec['arch']}"


def triton_bin_dir() -> Path | None:
    """Triton's bundled CUDA tools (``cuobjdump``, ``nvdisasm``), or None."""
    try:
        import triton
    except Exception:  # pragma: no cover
        return None
    p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return p if (p / "cuobjdump").exists() else None


def res_usage(cubin: Path) -> dict[str, int]:
    """``REG``/``STACK``/``LOCAL``/``SHARED`` of the cubin's kernel from ``cuobjdump -res-usage``."""
    tb = triton_bin_dir()
    if tb is None:
        return {}
    out = subprocess.run([str(tb / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True,
                         text=True, check=False).stdout
    found = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL|SHARED):(\d+)", out)}
    return found


@dataclass(frozen=True)
class CompileReport:
    """Resources and instruction evidence of one compiled kernel variant."""

    name: str
    arch: str
    registers: int
    stack_bytes: int
    local_bytes: int
    dynamic_smem: int
    mma_instructions: dict[str, int]
    other_counts: dict[str, int]
    compile_s: float
    ptx_path: str
    cubin_path: str

    @property
    def spills(self) -> bool:
        return self.stack_bytes > 0 or self.local_bytes > 0 or self.other_counts.get(
            "ld.local", 0) > 0 or self.other_counts.get("st.local", 0) > 0

    @property
    def mma_count(self) -> int:
        return sum(self.mma_instructions.values())


def ptx_evidence(ptx: str, arch: str) -> tuple[dict[str, int], dict[str, int]]:
    """MMA instruction counts (by full opcode) and other counts of interest in a PTX text."""
    mma: dict[str, int] = {}
    for m in re.findall(MMA_PATTERNS[arch], ptx):
        mma[m] = mma.get(m, 0) + 1
    other = {k: len(re.findall(re.escape(k), ptx)) for k in (
        "ld.local", "st.local", "cp.async.cg.shared.global", "cp.async.ca.shared.global",
        "tcgen05.ld", "tcgen05.st", "tcgen05.alloc", "tcgen05.commit", "mbarrier.try_wait",
        "shfl.sync", "cvt.rn.bf16x2.f32", "cvt.rn.f16x2.e4m3x2")}
    return mma, other


def compile_and_collect(kernel: object, args: list, arch: str, name: str, out: Path, dynamic_smem: int,
                        extra_counts: tuple[str, ...] = ()) -> CompileReport:
    """``cute.compile`` one kernel for ``arch`` (child process only), keep its PTX and cubin under
    ``out`` as ``{name}.ptx/.cubin`` and read registers, stack, local memory and PTX evidence.
    ``extra_counts``: further PTX substrings to count into ``other_counts``."""
    import time

    import cutlass.cute as cute

    t0 = time.time()
    compiled = cute.compile(kernel, *args, options=f"--gpu-arch {ARCH_FLAGS[arch]}")
    dt = time.time() - t0
    ptx = str(compiled.artifacts.PTX)
    dump = out / "dump"
    ptx_dst, cubin_dst = out / f"{name}.ptx", out / f"{name}.cubin"
    if ".version" in ptx:  # the artifact is the PTX text itself
        ptx_dst.write_text(ptx)
    else:  # a path into the dump directory
        src = Path(ptx) if len(ptx) < 4096 and Path(ptx).exists() else sorted(dump.glob("*.ptx"))[-1]
        shutil.copy(src, ptx_dst)
    cubins = sorted(dump.glob("*.cubin"))
    if cubins:
        shutil.copy(cubins[-1], cubin_dst)
    else:
        cubin_dst.write_bytes(compiled.artifacts.CUBIN)
    text = ptx_dst.read_text()
    mma, other = ptx_evidence(text, arch)
    other.update({k: text.count(k) for k in extra_counts})
    res = res_usage(cubin_dst)
    return CompileReport(name=name, arch=arch, registers=res.get("REG", -1), stack_bytes=res.get("STACK", -1),
                         local_bytes=res.get("LOCAL", -1), dynamic_smem=dynamic_smem, mma_instructions=mma,
                         other_counts=other, compile_s=round(dt, 2), ptx_path=str(ptx_dst),
                         cubin_path=str(cubin_dst))


def compile_variant(spec: dict, out_dir: str | os.PathLike | None = None,
                    timeout: float = 300.0) -> CompileReport:
    """Compile one variant (module docstring) for ``spec["arch"]`` in a child process."""
    out = Path(out_dir or tempfile.mkdtemp(prefix="kvsieve_cute_"))
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CUTE_DSL_KEEP="ptx,cubin", CUTE_DSL_DUMP_DIR=str(out / "dump"),
               CUTE_DSL_ARCH=ARCH_FLAGS[spec["arch"]])
    (out / "dump").mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "kvsieve.kernels.aot.cute_compile", json.dumps(spec),
                           str(out)], env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)
    result = out / "result.json"
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(f"CuTe-DSL compile of {spec} failed:\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    return CompileReport(**json.loads(result.read_text()))


def _gather_args(spec: dict) -> tuple[object, list]:
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    from ..common.gather.cute.host import build_kernel

    kernel = build_kernel(spec)
    g = cute.AddressSpace.gmem
    bf = cutlass.BFloat16
    k_dtype = cutlass.Uint8 if spec["kind"] == "mla_fp8" else bf
    k_row = 656 if spec["kind"] == "mla_fp8" else spec["d_qk"]
    v_row = spec["d_qk"] if spec["kind"] != "gqa" else spec["d_v"]
    args = [make_ptr(bf, 0, g, 16), make_ptr(k_dtype, 0, g, 16), make_ptr(bf, 0, g, 16),
            make_ptr(cutlass.Int32, 0, g, 16), make_ptr(cutlass.Float32, 0, g, 16),
            make_ptr(cutlass.Float32, 0, g, 16), cutlass.Int32(1), cutlass.Int32(64),
            cutlass.Int32(1), cutlass.Int32(1), cutlass.Int64(8), cutlass.Int64(8), k_row, v_row,
            cutlass.Float32(0.1), make_fake_stream()]
    return kernel, args


def _worker(spec: dict, out: Path) -> None:  # runs in the child process
    if spec["kind"] == "topk_gvr":
        from cutlass.cute.runtime import make_fake_stream

        from ..topk.cute.compile import compile_args

        kernel, args = compile_args(spec["k"], make_fake_stream())
        extra = TOPK_PTX_COUNTS
    else:
        kernel, args = _gather_args(spec)
        extra = ()
    report = compile_and_collect(kernel, args, spec["arch"], variant_name(spec), out, kernel.smem_size,
                                 extra_counts=extra)
    (out / "result.json").write_text(json.dumps(asdict(report)))


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]), Path(sys.argv[2]))
