"""Kernel object and compile arguments of the CuTe-DSL GVR top-k, shared by the JIT path
(``host``), the ahead-of-time bundle (``kvsieve.kernels.aot.cute_bundle``) and the compile-only
report (``kvsieve.kernels.aot.cute_compile``)."""
from __future__ import annotations

__all__ = ["compile_args"]


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
