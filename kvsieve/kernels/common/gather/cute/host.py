"""Host side of the CuTe gather-attention kernel (``sm90``/``sm100``) shared by the GQA and MLA
CuTe decodes: arch check, kernel build and compile (JIT or from the ahead-of-time bundle), index
translation, launch, split merge.

Index choice (documented in docs/kernels.md (CuTe-DSL section)): the CuTe kernels take FlashMLA-style
**physical row ids** ``[num_tokens, num_kv_heads, L]`` int32 (-1 = skip), ``L`` a multiple of the
kernel's ``BN``. The request-local selections of ``SparseRuntimeParams`` (``indices [H, total]``
+ ``offsets`` + ``block_table`` + ``token_to_req`` + ``kv_lens``) are translated here with
:func:`kvsieve.kernels.common.indexing.to_physical_slots` (entries ``>= kv_lens[t]`` become -1
first), so the kernel does no block-table walk and no length test. Padding to ``[T, L]`` reads the
longest selection on the host (one sync); callers with a fixed top-k call
``kvsieve.kernels.sparse_mla_decode.cute.sparse_mla_decode_slots``.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from ...cute import ARCH_FLAGS, detect_arch
from ...indexing import to_physical_slots
from ...merge_states.naive import merge_states

LOG2E = 1.4426950408889634
BLOCK_N = {"sm90": 64, "sm100": 32}
NUM_SMS = {"sm90": 132, "sm100": 148}


def require_arch(device: torch.device) -> str:
    """``"sm90"``/``"sm100"`` for ``device``; ValueError naming the alternative otherwise."""
    arch = detect_arch(device)
    if arch is None:
        raise ValueError(f"device: the CuTe kernels are built for SM90 (sm_90a) and SM100 "
                         f"(sm_100a) GPUs, got {device}; use the 'triton' backend (any CUDA GPU) "
                         f"or 'vanilla' (CPU)")
    return arch


def build_kernel(spec: dict):
    """The kernel object of a spec: ``{"arch", "kind": mla|mla_fp8|gqa, "d_qk", "d_v",
    "dv_tile", "group", "num_kv_heads", "block_n"}``."""
    if spec["arch"] == "sm90":
        from .sm90 import GatherAttentionSm90 as K
    else:
        from .sm100 import GatherAttentionSm100 as K
    kind = spec["kind"]
    return K(spec["d_qk"], spec["d_v"], spec["dv_tile"], spec["group"], spec["num_kv_heads"],
             spec["block_n"], v_in_k=kind != "gqa", kv_fp8=kind == "mla_fp8")


def compile_args(arch: str, spec: dict, block_n: int) -> tuple[object, list]:
    """Kernel object and null-pointer compile arguments of one compile key ``spec`` (``kind``,
    ``d_qk``, ``d_v``, ``dv_tile``, ``group``, ``hkv``, ``k_row``, ``v_row``); also used by the
    ahead-of-time export (``kvsieve.kernels.aot.cute_bundle``)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr
    import cuda.bindings.driver as cuda

    kernel = build_kernel(dict(arch=arch, kind=spec["kind"], d_qk=spec["d_qk"], d_v=spec["d_v"],
                               dv_tile=spec["dv_tile"], group=spec["group"], num_kv_heads=spec["hkv"],
                               block_n=block_n))
    g, bf = cute.AddressSpace.gmem, cutlass.BFloat16
    kd = cutlass.Uint8 if spec["kind"] == "mla_fp8" else bf
    args = [make_ptr(bf, 0, g, 16), make_ptr(kd, 0, g, 16), make_ptr(bf, 0, g, 16),
            make_ptr(cutlass.Int32, 0, g, 16), make_ptr(cutlass.Float32, 0, g, 16),
            make_ptr(cutlass.Float32, 0, g, 16), cutlass.Int32(1), cutlass.Int32(1),
            cutlass.Int32(1), cutlass.Int32(1), cutlass.Int64(8), cutlass.Int64(8), spec["k_row"],
            spec["v_row"], cutlass.Float32(1.0), cuda.CUstream(0)]
    return kernel, args


@lru_cache(maxsize=None)
def _compiled(arch: str, kind: str, d_qk: int, d_v: int, dv_tile: int, group: int, hkv: int,
              k_row: int, v_row: int):
    """JIT-compile one key; returns a launcher taking raw values (as ``aot.AotKernel``)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr
    import cuda.bindings.driver as cuda

    spec = dict(kind=kind, d_qk=d_qk, d_v=d_v, dv_tile=dv_tile, group=group, hkv=hkv, k_row=k_row,
                v_row=v_row)
    kernel, args = compile_args(arch, spec, BLOCK_N[arch])
    fn = cute.compile(kernel, *args, options=f"--gpu-arch {ARCH_FLAGS[arch]}")
    g, bf, f32, i32 = cute.AddressSpace.gmem, cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    kd = cutlass.Uint8 if kind == "mla_fp8" else bf

    def launch_jit(q, k, v, rows, o, lse, t, length, splits, tps, q_s0, q_s1, scale_log2, stream):
        fn(make_ptr(bf, q, g, 16), make_ptr(kd, k, g, 16), make_ptr(bf, v, g, 16),
           make_ptr(i32, rows, g, 16), make_ptr(f32, o, g, 16), make_ptr(f32, lse, g, 16), i32(t),
           i32(length), i32(splits), i32(tps), cutlass.Int64(q_s0), cutlass.Int64(q_s1), k_row,
           v_row, f32(scale_log2), cuda.CUstream(stream))
    return launch_jit


def _kernel(arch: str, spec: dict):
    """The launcher of a compile key: from the ahead-of-time bundle named by
    ``KVSIEVE_CUTE_AOT`` when set (refusing keys or archs it lacks), else JIT-compiled."""
    from ...cute_bundle import bundle_from_env, key_of
    bundle = bundle_from_env()
    if bundle is None:
        return _compiled(arch, **spec)
    if bundle.manifest["arch"] != arch:
        raise ValueError(f"KVSIEVE_CUTE_AOT: the bundle at {bundle.path} is built for "
                         f"{bundle.manifest['arch']}, this device is {arch}")
    return bundle.kernel(key_of(spec))


def merge_splits(o: torch.Tensor, lse: torch.Tensor, out_dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``o [S, T, H, Dv]`` fp32 / ``lse [S, T, H]`` (+inf = empty) over splits, through the
    one merge-states reference (:func:`kvsieve.kernels.common.merge_states.naive.merge_states`)."""
    if o.shape[0] == 1:
        return o[0].to(out_dtype), lse[0]
    return merge_states(o.permute(1, 2, 0, 3), lse.permute(1, 2, 0).contiguous(), out_dtype)


def launch(kind: str, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
           rows: torch.Tensor, d_v: int, sm_scale: float, num_splits: int | None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the gather-attention kernel. ``q [T, Hq, Dqk]`` bf16 (unit last stride, strides
    multiple of 8), ``k_rows [R, k_row]`` / ``v_rows [R, v_row]`` 2-D row views, ``rows
    [T, Hkv, L]`` int32 row ids (-1 skip), ``L % BN == 0``."""
    arch = require_arch(q.device)
    t, hq, d_qk = q.shape
    hkv, length = rows.shape[1], rows.shape[2]
    bn = BLOCK_N[arch]
    if length % bn:
        raise ValueError(f"rows: expected the selection length to be a multiple of {bn}")
    if q.stride(2) != 1 or q.stride(0) % 8 or q.stride(1) % 8:
        raise ValueError("q: expected a unit last stride and token/head strides multiple of 8")
    dv_tile = min(d_v, 256)
    group = hq // hkv
    m_rows = 64 if arch == "sm90" else 128
    programs = t * hkv * -(-group // m_rows) * (d_v // dv_tile)
    tiles = max(length // bn, 1)
    if num_splits is None:
        num_splits = max(1, min(tiles // 4, -(-2 * NUM_SMS[arch] // programs))) if programs < \
            2 * NUM_SMS[arch] else 1
    tps = -(-tiles // num_splits)
    o = torch.empty(num_splits, t, hq, d_v, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_splits, t, hq, dtype=torch.float32, device=q.device)
    fn = _kernel(arch, dict(kind=kind, d_qk=d_qk, d_v=d_v, dv_tile=dv_tile, group=group, hkv=hkv,
                            k_row=k_rows.stride(0), v_row=v_rows.stride(0)))
    rows = rows.contiguous()
    fn(q.data_ptr(), k_rows.data_ptr(), v_rows.data_ptr(), rows.data_ptr(), o.data_ptr(),
       lse.data_ptr(), t, length, num_splits, tps, q.stride(0), q.stride(1), sm_scale * LOG2E,
       torch.cuda.current_stream(q.device).cuda_stream)
    return merge_splits(o, lse, q.dtype)


def pad_rows(rows: torch.Tensor, block_n: int) -> torch.Tensor:
    """Pad the last dim of ``rows`` with -1 to a multiple of ``block_n`` (at least one tile)."""
    length = rows.shape[-1]
    pad = max(-(-length // block_n), 1) * block_n - length
    return torch.nn.functional.pad(rows, (0, pad), value=-1) if pad else rows


def request_local_to_rows(indices: torch.Tensor, offsets: torch.Tensor, token_to_req: torch.Tensor,
                          block_table: torch.Tensor, kv_lens: torch.Tensor, page_size: int,
                          block_size: int) -> torch.Tensor:
    """``[T, H, L]`` int32 physical slots (token granularity; blocks expanded to their
    ``block_size`` positions), -1 for padding and positions ``>= kv_lens[t]``."""
    t = offsets.shape[0] - 1
    h = indices.shape[0]
    lens = (offsets[1:] - offsets[:-1]).long()
    max_len = int(lens.max()) if t else 0
    tok = torch.repeat_interleave(torch.arange(t, device=indices.device), lens)
    col = torch.arange(indices.shape[1], device=indices.device) - offsets.long()[tok]
    sel = indices.long()  # [H, total]
    j = torch.arange(block_size, device=indices.device)
    pos = (sel[..., None] * block_size + j).reshape(h, -1)  # [H, total * B]
    ok = (sel[..., None] >= 0).expand(-1, -1, block_size).reshape(h, -1)
    tok_b = tok.repeat_interleave(block_size)
    ok = ok & (pos < kv_lens.long()[tok_b])
    local = torch.where(ok, pos, torch.full_like(pos, -1)).to(torch.int32)
    off_b = (offsets.long() * block_size).to(torch.int32)
    slots = to_physical_slots(local, off_b, token_to_req, block_table, page_size, 1)
    out = torch.full((t, h, max_len * block_size), -1, dtype=torch.int32,
                     device=indices.device)
    col_b = (col[:, None] * block_size + j).reshape(-1)
    out[tok_b[None, :].expand(h, -1), torch.arange(h, device=indices.device)[:, None],
        col_b[None, :].expand(h, -1)] = slots
    return out
