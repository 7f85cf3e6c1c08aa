"""Compile-only driver of the CuTe-DSL GVR top-k (no GPU needed).

Same recipe as ``kvsieve.kernels.cute._common.compile_variant`` (child process,
``CUTE_DSL_KEEP=ptx,cubin`` and ``CUTE_DSL_DUMP_DIR`` set before ``cutlass`` is imported,
pointer arguments and a fake stream) and the same readers (``res_usage`` on the DSL's cubin,
``ptx_evidence``, ``CompileReport``); only the kernel arguments differ, so the child entry is
this module: ``python -m kvsieve.kernels.cute.topk_gvr.compile SPEC_JSON OUT_DIR`` with
``SPEC = {"arch": "sm90"|"sm100", "kind": "topk_gvr", "k": 512|1024|2048}``.

``other_counts`` adds the top-k kernel's own PTX evidence: shared-memory atomics
(``atom.shared.add``), barriers (``bar.sync``), warp shuffles/ballots and 64-bit divisions.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from .._common import ARCH_FLAGS, CompileReport, compile_and_collect

PTX_COUNTS = ("atom.shared.add", "red.shared.add", "bar.sync", "barrier.sync", "shfl.sync.up",
              "shfl.sync.down", "ld.global", "st.global", "ld.shared", "st.shared", "div.s64",
              "div.u64")


def variant_name(spec: dict) -> str:
    return f"topk_gvr_k{spec['k']}_{spec['arch']}"


def compile_topk_variant(spec: dict, out_dir: str | os.PathLike | None = None,
                         timeout: float = 300.0) -> CompileReport:
    """Compile one top-k variant for ``spec["arch"]`` in a child process."""
    out = Path(out_dir or tempfile.mkdtemp(prefix="kvsieve_cute_topk_"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "dump").mkdir(exist_ok=True)
    env = dict(os.environ, CUTE_DSL_KEEP="ptx,cubin", CUTE_DSL_DUMP_DIR=str(out / "dump"),
               CUTE_DSL_ARCH=ARCH_FLAGS[spec["arch"]])
    proc = subprocess.run([sys.executable, "-m", "kvsieve.kernels.cute.topk_gvr.compile",
                           json.dumps(spec), str(out)], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    result = out / "result.json"
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(f"CuTe-DSL compile of {spec} failed:\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    return CompileReport(**json.loads(result.read_text()))


def compile_args(k: int, stream):
    """Kernel object and arguments of the top-k launch (null pointers: compile only)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    from .device import GvrTopK

    g = cute.AddressSpace.gmem
    i32 = cutlass.Int32
    args = [make_ptr(i32, 0, g, 4), make_ptr(i32, 0, g, 4), make_ptr(i32, 0, g, 4),
            make_ptr(i32, 0, g, 4), i32(1), i32(1), cutlass.Int64(1), cutlass.Int64(1), i32(0), stream]
    return GvrTopK(k), args


def _worker(spec: dict, out: Path) -> None:  # runs in the child process
    from cutlass.cute.runtime import make_fake_stream

    kernel, args = compile_args(spec["k"], make_fake_stream())
    report = compile_and_collect(kernel, args, spec["arch"], variant_name(spec), out, kernel.smem_size,
                                 extra_counts=PTX_COUNTS)
    (out / "result.json").write_text(json.dumps(asdict(report)))


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]), Path(sys.argv[2]))
