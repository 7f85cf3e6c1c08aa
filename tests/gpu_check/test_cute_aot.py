"""The CuTe-DSL ahead-of-time bundle, as far as a machine without a GPU allows: the DSL's export
produces a header and an object file, the bundle links into one library that needs only libc (the
CUDA runtime is static, the driver is opened at run time), its manifest records sizes and the
checksum, the ctypes loader resolves every entry point and gets as far as the driver (CUDA error
35, no driver here), and it refuses stale copies, unknown kernels and a missing bundle."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvsieve.kernels.common.cute import cute_available

ROOT = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024


def _toolchain() -> str:
    ok, why = cute_available()
    if not ok:
        return why
    if shutil.which("gcc") is None:
        return "gcc not found"
    from kvsieve.kernels.aot.cute_bundle import _cuda_static
    try:
        _cuda_static()
    except RuntimeError as e:
        return str(e)
    return ""


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    why = _toolchain()
    if why:
        pytest.skip(f"building a bundle needs the DSL, gcc and a CUDA toolkit: {why}")
    from kvsieve.kernels.aot.cute_bundle import build
    out = tmp_path_factory.mktemp("cute_aot")
    manifest = build(out, "sm90", jobs=1, variants=(dict(kind="topk_gvr", k=512),))
    return out, manifest


def test_bundle_files_and_size_budget(bundle):
    out, manifest = bundle
    assert manifest["arch"] == "sm90" and list(manifest["kernels"]) == ["topk_gvr_k512"]
    entry = manifest["kernels"]["topk_gvr_k512"]
    # the wrapper's arguments: 4 pointers, rows, width, two int64 strides, the stats flag, the stream
    assert entry["params"] == ["void *"] * 4 + ["int32_t", "int32_t", "int64_t", "int64_t", "int32_t", "cudaStream_t"]
    assert entry["object_bytes"] > 4096  # host code + the embedded cubin
    lib = out / manifest["library"]
    assert lib.stat().st_size == manifest["library_bytes"] < 4 * MIB
    files = [p for p in out.iterdir() if p.is_file() and p.name != "manifest.json"]
    assert manifest["bundle_bytes"] == sum(p.stat().st_size for p in files)
    needed = subprocess.run(["ldd", str(lib)], capture_output=True, text=True).stdout
    assert "libcudart" not in needed and "libcute_dsl_runtime" not in needed and "libcuda.so" not in needed


def test_loader_reaches_the_driver(bundle):
    from kvsieve.kernels.common.cute_bundle import AotBundle
    b = AotBundle(bundle[0])
    k = b.kernel("topk_gvr_k512")
    with pytest.raises(RuntimeError, match=r"CUDA error \d+ \(cudaError\w+\)"):
        k.load()
    with pytest.raises(ValueError, match="has no kernel 'topk_gvr_k1024'"):
        b.kernel("topk_gvr_k1024")


def test_check_command(bundle, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "kvsieve.gpu_check.cute_aot", "check", "--bundle", str(bundle[0]),
                           "--json", str(tmp_path / "r.json")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["library_bytes"] == bundle[1]["library_bytes"]
    assert "loading the cubin failed with CUDA error" in res["kernels"]["topk_gvr_k512"]
    missing = subprocess.run([sys.executable, "-m", "kvsieve.gpu_check.cute_aot", "check", "--bundle",
                              str(tmp_path / "none")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 3 and "no CuTe AOT bundle" in missing.stdout


def test_stale_library_refused(bundle, tmp_path):
    from kvsieve.kernels.common.cute_bundle import AotBundle
    copy = tmp_path / "copy"
    shutil.copytree(bundle[0], copy)
    lib = copy / bundle[1]["library"]
    lib.write_bytes(lib.read_bytes()[:-1])
    with pytest.raises(ValueError, match="checksum differs"):
        AotBundle(copy)


def test_shim_matches_the_export_header():
    from kvsieve.kernels.aot.cute_bundle import _shim, _signature
    header = ("static inline int32_t cute_dsl_k_wrapper(k_Kernel_Module_t *module, void *a, int32_t n, "
              "int64_t s, float x, cudaStream_t stream) {")
    assert _signature("k", header) == ["void *", "int32_t", "int64_t", "float", "cudaStream_t"]
    src = _shim("k", header)
    assert "int kvsieve_k_run(void *a, int32_t n, int64_t s, float x, cudaStream_t stream)" in src
    assert "cute_dsl_k_wrapper(&mod_, a, n, s, x, stream)" in src
    assert "cudaGetDeviceCount(&count);\n    if (ret != cudaSuccess) return (int)ret;" in src
    with pytest.raises(RuntimeError, match="export format changed"):
        _shim("k", "nothing here")
