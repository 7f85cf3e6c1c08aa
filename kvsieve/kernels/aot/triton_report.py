"""AOT resource report of the attention kernels: each compiled at its shipped sm90/sm100 config,
no GPU needed (driver: :mod:`.triton_compile`).

``python -m kvsieve.kernels.aot.triton_report`` prints a markdown table (``--json`` for JSON) of
registers, spill bytes, shared memory, TMEM and the MMA instruction family. Must run without
``TRITON_INTERPRET=1``. The representative shapes are bf16, GQA 8 KV heads x group 8 x head_dim
128, MLA 512 + 64 with 128 heads, merge over 32 splits of 512 columns.
"""
from __future__ import annotations

from ..common import launch
from . import triton_compile
from .triton_compile import ARCH_KEY, KernelSpec

__all__ = ["attention_specs", "main"]


def attention_specs(cc: int) -> list[KernelSpec]:
    """The shipped configurations of the attention kernels for compute capability ``cc`` (90 or 100)."""
    from ..common.gather.triton import gather_attn_fwd
    from ..common.merge_states.triton import merge_states_kernel
    from ..compact_kv.triton import compact_kernel
    from ..paged_prefill.triton import prefill_fwd

    arch = ARCH_KEY[cc]
    g = launch.gqa_decode_config(arch, 128)
    m = launch.mla_decode_config(arch, 128)
    p = launch.prefill_config(arch, 128, 8)
    attn_ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "BT": "*i32", "TOK2REQ": "*i32",
                 "KVLEN": "*i32", "IDX": "*i32", "OFF": "*i32", "O": "*bf16", "LSE": "*fp32",
                 "STATS": "*i32"}
    common = dict(SEL_BLOCK=1, SPARSE=True, COUNT=False, F32DOT=False, N_HBLOCKS=1,
                  PAGE_SIZE=64)
    gqa = dict(common, GROUP=8, DA=128, DB=0, DV=128, BLOCK_H=16, BLOCK_N=g.block_n,
               BLOCK_DA=128, BLOCK_DB=16, BLOCK_DV=128, V_IS_K=False)
    mla = dict(common, GROUP=128, N_HBLOCKS=128 // m.block_h, DA=512, DB=64, DV=512,
               BLOCK_H=m.block_h, BLOCK_N=m.block_n, BLOCK_DA=512, BLOCK_DB=64,
               BLOCK_DV=512, V_IS_K=True, SKIP=False)
    split_ptrs = dict(attn_ptrs, O="*fp32")
    pre_ptrs = {k: v for k, v in attn_ptrs.items() if k not in ("IDX", "OFF")}
    pre_ptrs.update(TSTART="*i32", TCOUNT="*i32")
    return [
        KernelSpec("sparse_gqa_decode", gather_attn_fwd, attn_ptrs, dict(gqa, SKIP=False),
                   g.num_warps, g.num_stages),
        KernelSpec("sparse_gqa_decode +skip", gather_attn_fwd, attn_ptrs,
                   dict(gqa, SKIP=True), g.num_warps, g.num_stages),
        KernelSpec("sparse_mla_decode (split-K)", gather_attn_fwd, split_ptrs, mla,
                   m.num_warps, m.num_stages),
        KernelSpec("paged_prefill dense", prefill_fwd, pre_ptrs,
                   dict(GROUP=8, GROUP_PAD=8, PAGE_SIZE=64, DA=128, DB=0, DV=128,
                        BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_DA=128, BLOCK_DB=16,
                        BLOCK_DV=128, SKIP=False, COUNT=False, F32DOT=False),
                   p.num_warps, p.num_stages),
        KernelSpec("merge_states", merge_states_kernel,
                   {"V": "*fp32", "S": "*fp32", "O": "*bf16", "LSE": "*fp32"},
                   dict(D=512, BLOCK_S=32, BLOCK_D=512), launch.MERGE_NUM_WARPS, 1),
        KernelSpec("compact_kv_", compact_kernel,
                   {"K": "*bf16", "V": "*bf16", "BT": "*i32", "KEEP": "*i32"},
                   dict(PAGE_SIZE=64, DK=128, DV=128, BLOCK_N=launch.COMPACT_BLOCK_N[arch],
                        BLOCK_DK=128, BLOCK_DV=128, HAS_V=True), 4, 1),
    ]


def main(argv: list[str] | None = None) -> int:
    """Print the attention kernels' AOT resource table (markdown, or JSON with ``--json``)."""
    return triton_compile.main(argv, attention_specs, prog="python -m kvsieve.kernels.aot.triton_report")


if __name__ == "__main__":
    raise SystemExit(main())
