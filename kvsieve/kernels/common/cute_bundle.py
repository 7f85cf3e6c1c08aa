"""Running kernels from a CuTe-DSL ahead-of-time bundle (built by :mod:`kvsieve.kernels.aot.cute_bundle`):
``KVSIEVE_CUTE_AOT=<bundle dir>`` makes the CuTe host code (``sparse_mla_decode.host``,
``topk_gvr.kernel``) launch from the bundle's shared library (ctypes, only the driver needed)
instead of compiling. Kept apart from the build side so the host code imports no builder."""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
from pathlib import Path

__all__ = ["ENV_VAR", "AotBundle", "AotKernel", "bundle_from_env", "key_of", "sha256_of"]

ENV_VAR = "KVSIEVE_CUTE_AOT"
CTYPES = {"void *": ctypes.c_void_p, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
          "float": ctypes.c_float, "cudaStream_t": ctypes.c_void_p}


def key_of(spec: dict) -> str:
    """The symbol-safe name of a compile key."""
    if spec["kind"] == "topk_gvr":
        return f"topk_gvr_k{spec['k']}"
    return (f"{spec['kind']}_q{spec['d_qk']}_v{spec['d_v']}_t{spec['dv_tile']}_g{spec['group']}"
            f"_h{spec['hkv']}_kr{spec['k_row']}_vr{spec['v_row']}")


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class AotKernel:
    """One bundled kernel: ``kernel(*args)`` with the header wrapper's arguments in order (device
    pointers as ints, int32/int64/float scalars, the CUDA stream handle as an int)."""

    def __init__(self, lib: ctypes.CDLL, name: str, params: list[str]) -> None:
        self.name = name
        self._error_name = lib.kvsieve_cuda_error_name
        self._error_name.restype = ctypes.c_char_p
        self._load = getattr(lib, f"kvsieve_{name}_load")
        self._load.restype = ctypes.c_int
        self._run = getattr(lib, f"kvsieve_{name}_run")
        self._run.restype = ctypes.c_int32
        self._run.argtypes = [CTYPES[p] for p in params]

    def load(self) -> None:
        """Load the cubin onto the current device; RuntimeError with the CUDA error code if not."""
        err = self._load()
        if err:
            raise RuntimeError(f"{self.name}: loading the cubin failed with CUDA error {err} "
                               f"({self._error_name(err).decode()})")

    def __call__(self, *args) -> None:
        self.load()
        ret = self._run(*args)
        if ret:
            raise RuntimeError(f"{self.name}: launch returned {ret}")


class AotBundle:
    """A bundle folder (``manifest.json`` + the library); the library's checksum is verified."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        mf = self.path / "manifest.json"
        if not mf.exists():
            raise FileNotFoundError(f"{ENV_VAR}: no CuTe AOT bundle at {self.path} (no manifest.json); build one "
                                    f"with python -m kvsieve.kernels.aot.cute_bundle build --out {self.path}")
        self.manifest = json.loads(mf.read_text())
        lib = self.path / self.manifest["library"]
        if sha256_of(lib) != self.manifest["library_sha256"]:
            raise ValueError(f"{lib}: checksum differs from manifest.json (a partial or stale copy)")
        self._lib = ctypes.CDLL(str(lib))
        self._kernels: dict[str, AotKernel] = {}

    @property
    def keys(self) -> list[str]:
        return sorted(self.manifest["kernels"])

    def kernel(self, key: str) -> AotKernel:
        if key not in self.manifest["kernels"]:
            raise ValueError(f"{ENV_VAR}: the bundle at {self.path} has no kernel {key!r} (it was built for "
                             f"{self.keys}); rebuild it with that shape in BUNDLE_VARIANTS or unset {ENV_VAR}")
        if key not in self._kernels:
            self._kernels[key] = AotKernel(self._lib, key, self.manifest["kernels"][key]["params"])
        return self._kernels[key]


_BUNDLES: dict[str, AotBundle] = {}


def bundle_from_env() -> AotBundle | None:
    """The bundle named by ``KVSIEVE_CUTE_AOT``, or None when the variable is unset."""
    path = os.environ.get(ENV_VAR)
    if not path:
        return None
    if path not in _BUNDLES:
        _BUNDLES[path] = AotBundle(path)
    return _BUNDLES[path]
