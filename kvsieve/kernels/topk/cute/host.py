"""Host side of the CuTe-DSL GVR top-k: ``gvr_topk(scores, lengths, k, out)``, the entry point
``kvsieve.kernels.topk.plan`` calls for the ``cute_gvr`` engine.

Importing this module needs neither a GPU nor ``cutlass``: the DSL is imported, and the kernel
compiled (once per (arch, k)), on the first call. Contract, tie rule and result: as
``kvsieve.kernels.topk.naive`` (positions ascending, ``-1`` padded, ties at the k-th
value go to the lowest positions), restricted to ``k`` in {512, 1024, 2048} on SM90 (sm_90a),
SM100 (sm_100a) and SM103 (sm_103a). The algorithm is in ``device.py``; ``mirror.py`` is a
PyTorch transcription of it, step for step, that the CPU tests check against the references.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from ..naive import check_topk_args

__all__ = ["gvr_topk", "SUPPORTED_K", "GPU_ARCH"]

SUPPORTED_K = (512, 1024, 2048)
GPU_ARCH = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}


def gpu_arch(device: torch.device) -> str:
    """The ``--gpu-arch`` of a CUDA device; ValueError naming the device otherwise."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"scores: the CuTe-DSL GVR top-k runs on CUDA SM90/SM100/SM103 devices, "
                         f"got {device}; use the 'torch' or Triton 'gvr' engine")
    cc = torch.cuda.get_device_capability(device)
    if cc not in GPU_ARCH:
        raise ValueError(f"scores: the CuTe-DSL GVR top-k is built for SM90/SM100/SM103, got "
                         f"compute capability {cc[0]}.{cc[1]} ({device}); use the Triton 'gvr' engine")
    return GPU_ARCH[cc]


@lru_cache(maxsize=None)
def _compiled(arch: str, k: int):
    """JIT-compile the kernel for ``k``; returns a launcher taking raw values (as ``aot.AotKernel``)."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    from .compile import compile_args

    kernel, args = compile_args(k, cuda.CUstream(0))
    fn = cute.compile(kernel, *args, options=f"--gpu-arch {arch}")
    g, i32 = cute.AddressSpace.gmem, cutlass.Int32

    def launch_jit(scores, lens, out, stats, rows, width, s_stride, o_stride, with_stats, stream):
        fn(make_ptr(i32, scores, g, 4), make_ptr(i32, lens, g, 4), make_ptr(i32, out, g, 4),
           make_ptr(i32, stats, g, 4), i32(rows), i32(width), cutlass.Int64(s_stride),
           cutlass.Int64(o_stride), i32(with_stats), cuda.CUstream(stream))
    return launch_jit


def _kernel(arch: str, k: int):
    """The launcher for ``k``: from the ahead-of-time bundle named by ``KVSIEVE_CUTE_AOT`` when
    set (it holds sm_90a code only; other archs and missing k are refused), else JIT-compiled."""
    from ...common.cute_bundle import bundle_from_env, key_of
    bundle = bundle_from_env()
    if bundle is None:
        return _compiled(arch, k)
    if {"sm90": "sm_90a", "sm100": "sm_100a"}[bundle.manifest["arch"]] != arch:
        raise ValueError(f"KVSIEVE_CUTE_AOT: the bundle at {bundle.path} is built for "
                         f"{bundle.manifest['arch']}, this device needs {arch}")
    return bundle.kernel(key_of(dict(kind="topk_gvr", k=k)))


def _check_out(scores: torch.Tensor, k: int, out: torch.Tensor | None) -> torch.Tensor:
    rows = scores.shape[0]
    if out is None:
        return torch.empty(rows, k, dtype=torch.int32, device=scores.device)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.int32 or tuple(out.shape) != (rows, k) \
            or out.stride(1) != 1 or out.device != scores.device:
        raise ValueError(f"out: expected an int32 [{rows}, {k}] tensor with unit column stride on "
                         f"{scores.device}")
    return out


def gvr_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int, out: torch.Tensor | None = None,
             *, stats: torch.Tensor | None = None) -> torch.Tensor:
    """Exact top-``k`` positions of each row of ``scores [rows, width]`` fp32 over its first
    ``lengths[r]`` entries (int32 ``[rows]``), into ``out [rows, k]`` int32 (allocated when
    None) and returned. ``stats [rows]`` int32, optional, receives 1 for rows that took the
    in-kernel full-row fallback (the guess gave fewer than ``k`` or more than the scratch's
    candidates), else 0. Lengths above ``width`` are read as ``width``."""
    check_topk_args(scores, lengths, k)
    if k not in SUPPORTED_K:
        raise ValueError(f"k: the CuTe-DSL GVR top-k supports k in {list(SUPPORTED_K)}, got {k}")
    res = _check_out(scores, k, out)
    if stats is not None and (not isinstance(stats, torch.Tensor) or stats.dtype != torch.int32
                              or tuple(stats.shape) != (scores.shape[0],)
                              or stats.device != scores.device or not stats.is_contiguous()):
        raise ValueError(f"stats: expected a contiguous int32 [{scores.shape[0]}] tensor on {scores.device}")
    arch = gpu_arch(scores.device)
    rows, width = scores.shape
    if rows == 0:
        return res
    if rows >= 2 ** 31 or width >= 2 ** 31:
        raise ValueError(f"scores: shape {tuple(scores.shape)} exceeds the kernel's int32 indexing")
    fn = _kernel(arch, k)
    lens = lengths.contiguous()
    st = stats if stats is not None else res
    fn(scores.data_ptr(), lens.data_ptr(), res.data_ptr(), st.data_ptr(), rows, width, scores.stride(0),
       res.stride(0), int(stats is not None), torch.cuda.current_stream(scores.device).cuda_stream)
    return res
