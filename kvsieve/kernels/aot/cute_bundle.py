"""Ahead-of-time bundle of the CuTe-DSL kernels: compile here, run where the DSL is not installed.

The GPU machine has no ``nvidia-cutlass-dsl`` and only 64 MiB travel with a command, while the
DSL's runtime wheel is 92 MB. The DSL's own export (``JitCompiledFunction.export_to_c``) writes,
per compiled kernel, a C header (the host launch wrapper) and an object file (host launch code +
the embedded sm_90a cubin). ``build`` links those objects, one generated C shim per kernel, the
DSL's 52 KB ``libcuda_dialect_runtime_static.a`` and CUDA's static runtime into **one shared
library that needs only the driver (libcuda)** — no Python DSL, no MLIR runtime.
:class:`kvsieve.kernels.common.cute_bundle.AotBundle` loads it with ctypes; ``KVSIEVE_CUTE_AOT=<bundle
dir>`` makes the CuTe host code (``kvsieve.kernels.common.gather.cute.host``,
``kvsieve.kernels.topk.cute.host``) launch from it instead of compiling.

    python -m kvsieve.kernels.aot.cute_bundle build --out .cute_aot/sm90   # here: DSL + gcc + CUDA static runtime
    KVSIEVE_CUTE_AOT=.cute_aot/sm90 python ...                              # there: only torch and the driver

A bundle holds one variant per compile key (``key_of``): the attention kernels are specialised on
(kind, head group, KV heads, row strides), so only the shapes listed in ``BUNDLE_VARIANTS`` can
run from it; any other key is refused by name. Export quirks handled here: the header generator
needs the ``stream`` parameter annotated (``cuda.CUstream``; the kernels leave it bare), the
object dump resolves the runtime's symbols in-process (``libcute_dsl_runtime.so`` is preloaded),
and the header's inline module loader loops over a device count it never checked, so each shim
loads the cubin itself and returns the CUDA error code.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..common.cute import ARCH_FLAGS
from ..common.cute_bundle import key_of, sha256_of

__all__ = ["BUNDLE_VARIANTS", "LIB_NAME", "build"]

LIB_NAME = "libkvsieve_cute.so"
# attention: MLA 128 heads (bf16 and FP8 rows), GQA 2 KV heads x group 8 at head_dim 128; top-k k=512/2048
BUNDLE_VARIANTS = (
    dict(kind="mla", d_qk=576, d_v=512, dv_tile=256, group=128, hkv=1, k_row=576, v_row=576),
    dict(kind="mla_fp8", d_qk=576, d_v=512, dv_tile=256, group=128, hkv=1, k_row=656, v_row=656),
    dict(kind="gqa", d_qk=128, d_v=128, dv_tile=128, group=8, hkv=2, k_row=128, v_row=128),
    dict(kind="topk_gvr", k=512),
    dict(kind="topk_gvr", k=2048),
)


def _runtime_dir() -> Path:
    from cutlass.cute.export.aot_config import get_libdir
    return Path(get_libdir())


def _export_worker(spec: dict, arch: str, out: Path) -> None:  # child process
    ctypes.CDLL(str(_runtime_dir() / "libcute_dsl_runtime.so"), mode=os.RTLD_GLOBAL)
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute

    if spec["kind"] == "topk_gvr":
        from ..topk.cute.compile import compile_args
        kernel, args = compile_args(spec["k"], cuda.CUstream(0))
    else:
        from ..common.gather.cute.host import BLOCK_N, compile_args
        kernel, args = compile_args(arch, spec, BLOCK_N[arch])
    type(kernel).__call__.__annotations__["stream"] = cuda.CUstream  # the header generator needs it
    compiled = cute.compile(kernel, *args, options=f"--gpu-arch {ARCH_FLAGS[arch]}")
    compiled.export_to_c(str(out), key_of(spec))


def _shim(name: str, header: str) -> str:
    """C source exporting ``kvsieve_<name>_load()`` (0 or the CUDA error) and
    ``kvsieve_<name>_run(...)`` (the header's wrapper, minus the module argument)."""
    m = re.search(rf"cute_dsl_{name}_wrapper\({name}_Kernel_Module_t \*module, ([^)]*)\)", header)
    if m is None:
        raise RuntimeError(f"{name}.h: no cute_dsl_{name}_wrapper found; DSL export format changed")
    params = m.group(1)
    names = [p.strip().rsplit(" ", 1)[-1].lstrip("*") for p in params.split(",")]
    return f"""#include "{name}.h"
static {name}_Kernel_Module_t mod_;
static int loaded_ = 0;
int kvsieve_{name}_load(void) {{
    int count = 0, dev = 0;
    cudaError_t ret = cudaGetDeviceCount(&count);
    if (ret != cudaSuccess) return (int)ret;
    if ((ret = cudaGetDevice(&dev)) != cudaSuccess) return (int)ret;
    if (loaded_) return 0;
    cudaLibrary_t *lib = &mod_.module;
    struct {{ cudaLibrary_t **lib; cudaError_t *ret; }} init = {{&lib, &ret}};
    _mlir_{name}_cuda_init((void **)&init);
    if (ret != cudaSuccess) return (int)ret;
    int32_t device_id = dev;
    struct {{ cudaLibrary_t **lib; int32_t *device_id; cudaError_t *ret; }} load = {{&lib, &device_id, &ret}};
    _mlir_{name}_cuda_load_to_device((void **)&load);
    if (ret == cudaSuccess) loaded_ = 1;
    return (int)ret;
}}
int kvsieve_{name}_run({params}) {{
    return cute_dsl_{name}_wrapper(&mod_, {", ".join(names)});
}}
"""


def _signature(name: str, header: str) -> list[str]:
    m = re.search(rf"cute_dsl_{name}_wrapper\({name}_Kernel_Module_t \*module, ([^)]*)\)", header)
    types = [p.strip().rsplit(" ", 1)[0].strip() + (" *" if "*" in p else "") for p in m.group(1).split(",")]
    return [("void *" if t.endswith("*") else t) for t in types]


def _cuda_static() -> tuple[Path, Path]:
    """(CUDA include dir, libcudart_static.a) of the local toolkit."""
    for root in [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", *sorted(map(str, Path("/usr/local").glob("cuda-*")))]:
        if not root:
            continue
        for lib in ("lib64", "lib", "targets/x86_64-linux/lib"):
            a = Path(root) / lib / "libcudart_static.a"
            if a.exists() and (Path(root) / "include" / "cuda_runtime.h").exists():
                return Path(root) / "include", a
    raise RuntimeError("build: needs a CUDA toolkit with include/cuda_runtime.h and libcudart_static.a "
                       "(set CUDA_HOME)")


def build(out: str | os.PathLike, arch: str = "sm90", jobs: int = 2, timeout: float = 600.0,
          variants: tuple[dict, ...] = BUNDLE_VARIANTS) -> dict:
    """Export ``variants`` (default: every ``BUNDLE_VARIANTS`` kernel) for ``arch`` and link the
    bundle into ``out``; returns (and writes) ``manifest.json``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    include, cudart = _cuda_static()
    work = Path(tempfile.mkdtemp(prefix="kvsieve_cute_aot_"))

    def export(spec: dict) -> None:
        env = dict(os.environ, CUTE_DSL_ARCH={"sm90": "sm_90a", "sm100": "sm_100a"}[arch])
        proc = subprocess.run([sys.executable, "-m", "kvsieve.kernels.aot.cute_bundle", "_export", json.dumps(spec),
                               arch, str(work)], env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"export of {key_of(spec)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")

    with ThreadPoolExecutor(max_workers=jobs) as ex:
        list(ex.map(export, variants))
    kernels, sources = {}, []
    for spec in variants:
        name = key_of(spec)
        header = (work / f"{name}.h").read_text()
        (work / f"{name}_shim.c").write_text(_shim(name, header))
        sources += [str(work / f"{name}_shim.c"), str(work / f"{name}.o")]
        kernels[name] = {"spec": spec, "params": _signature(name, header),
                         "object_bytes": (work / f"{name}.o").stat().st_size}
        shutil.copy(work / f"{name}.h", out / f"{name}.h")
    (work / "errors.c").write_text("#include <cuda_runtime.h>\nconst char *kvsieve_cuda_error_name(int e) "
                                   "{ return cudaGetErrorName((cudaError_t)e); }\n")
    sources.append(str(work / "errors.c"))
    lib = out / LIB_NAME
    cmd = ["gcc", "-shared", "-fPIC", "-O2", f"-I{include}", f"-I{work}", "-o", str(lib), *sources,
           str(_runtime_dir() / "libcuda_dialect_runtime_static.a"), str(cudart), "-ldl", "-lpthread", "-lrt"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"link failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    from importlib.metadata import version
    files = [p for p in out.iterdir() if p.is_file() and p.name != "manifest.json"]
    manifest = {"arch": arch, "dsl_version": version("nvidia-cutlass-dsl"), "library": LIB_NAME,
                "library_bytes": lib.stat().st_size, "library_sha256": sha256_of(lib), "kernels": kernels,
                # every file of the bundle but the manifest itself
                "bundle_bytes": sum(p.stat().st_size for p in files)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return manifest


if __name__ == "__main__":
    if sys.argv[1] == "_export":
        _export_worker(json.loads(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
    elif sys.argv[1] == "build":
        import argparse
        ap = argparse.ArgumentParser(prog="python -m kvsieve.kernels.aot.cute_bundle build")
        ap.add_argument("--out", required=True)
        ap.add_argument("--arch", default="sm90", choices=("sm90", "sm100"))
        ap.add_argument("--jobs", type=int, default=2)
        a = ap.parse_args(sys.argv[2:])
        m = build(a.out, a.arch, a.jobs)
        print(json.dumps({k: v for k, v in m.items() if k != "kernels"} | {"kernels": sorted(m["kernels"])}, indent=1))
    else:
        sys.exit("usage: python -m kvsieve.kernels.aot.cute_bundle build --out DIR [--arch sm90] [--jobs 2]")
