"""Compile a native CPU kernel's C source once per machine and load it with ctypes.

The library is built with the system C compiler (``$CC``, else ``cc``) for this machine's CPU
(``-march=native``), with ``include/`` (beside this module) on the include path, into
``default_cache_dir()/native/<stem>-<hash>.so``; the hash covers the source, the headers of
``include/``, the compiler, the flags and the CPU's feature flags, so a changed source or another
machine sharing the folder builds its own copy. A build is written beside its final name and
renamed into place, so concurrent first uses never load half a file.

``KVSIEVE_NATIVE=0`` turns every native kernel off (their callers then run the plain-PyTorch
path, which computes the same thing); ``1`` (the default) turns them on, any other value is an
error. A library that cannot be built is reported once per process with a ``RuntimeWarning``
naming the reason; :func:`native_status` says which path a process uses and why.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

from ...cache_dir import default_cache_dir

__all__ = ["ENV_VAR", "FLAGS", "INCLUDE", "NativeUnavailable", "native_library", "native_status"]

ENV_VAR = "KVSIEVE_NATIVE"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=fast", "-std=c11", "-fPIC", "-shared")

INCLUDE = Path(__file__).with_name("include")  # headers every kernel may include
_loaded: dict[Path, ctypes.CDLL | str] = {}  # source -> its library, or why it has none


class NativeUnavailable(RuntimeError):
    """No native library for this source in this process (the message says why)."""


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _build(source: Path) -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise NativeUnavailable("no C compiler (set $CC, or install cc)")
    headers = [h.read_bytes() for h in sorted(INCLUDE.glob("*.h"))]
    digest = hashlib.sha256(b"\0".join([source.read_bytes(), *headers, cc.encode(), " ".join(FLAGS).encode(),
                                        _cpu_flags().encode()]))
    out = default_cache_dir() / "native" / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            try:
                done = subprocess.run([cc, *FLAGS, f"-I{INCLUDE}", "-o", tmp, str(source), "-lm"], capture_output=True, text=True)
            except OSError as e:
                raise NativeUnavailable(f"cannot run the C compiler {cc}: {e}") from e
            if done.returncode != 0:
                raise NativeUnavailable(f"{cc} failed on {source.name}: {done.stderr.strip()[-400:]}")
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        return ctypes.CDLL(str(out))
    except OSError as e:
        raise NativeUnavailable(f"cannot load {out}: {e}") from e


def native_library(source: Path) -> ctypes.CDLL:
    """The loaded library of C file ``source``, built on first use; raises
    :class:`NativeUnavailable` (with the reason) when it is turned off or cannot be built."""
    switch = os.environ.get(ENV_VAR, "1")
    if switch not in ("0", "1"):
        raise ValueError(f"{ENV_VAR} must be 0 (native kernels off) or 1 (on, the default), got {switch!r}")
    if switch == "0":
        raise NativeUnavailable(f"turned off by {ENV_VAR}=0")
    found = _loaded.get(source)
    if found is None:
        try:
            found = _build(source)
        except NativeUnavailable as e:
            found = str(e)
            warnings.warn(f"kvsieve: the native CPU kernel {source.name} is unavailable ({found}); its PyTorch "
                          f"path runs instead (same results, slower). {ENV_VAR}=0 chooses that path without "
                          "trying to build.", RuntimeWarning, stacklevel=2)
        _loaded[source] = found
    if isinstance(found, str):
        raise NativeUnavailable(found)
    return found


def native_status(source: Path) -> str:
    """``"native"`` when ``source``'s library loads in this process, else ``"torch (<why>)"``."""
    try:
        native_library(source)
    except NativeUnavailable as e:
        return f"torch ({e})"
    return "native"
