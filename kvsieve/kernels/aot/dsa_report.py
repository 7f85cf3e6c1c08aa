"""AOT resource report of the DSA kernels (indexer logits, radix and GVR top-k), no GPU needed.

``python -m kvsieve.kernels.aot.dsa_report`` compiles each kernel at its shipped
sm90/sm100 launch config and prints registers, spills, shared memory and MMA family, with the
driver of :mod:`.triton_compile` (the table format of ``triton_report``). Shapes: DeepSeek-V3.2 indexer
(64 heads x 128, bf16 and FP8 keys, page 64), top-k k = 2048.
"""
from __future__ import annotations

from ..dsa_indexer.plan import INDEXER_LAUNCH
from ..topk.plan import TOPK_LAUNCH
from ..topk.naive import GVR_BINS, GVR_SAMPLE
from . import triton_compile
from .triton_compile import ARCH_KEY, KernelSpec

__all__ = ["dsa_specs", "main"]


def dsa_specs(cc: int) -> list[KernelSpec]:
    """The shipped configurations for compute capability ``cc`` (90 or 100)."""
    from ..dsa_indexer.triton import indexer_logits_kernel
    from ..topk.triton import gvr_topk_kernel, radix_topk_kernel

    arch = ARCH_KEY[cc]
    ix, tk = INDEXER_LAUNCH[arch], TOPK_LAUNCH[arch]
    specs = []
    for name, qk, paged in (("dsa_indexer decode bf16", "*bf16", True), ("dsa_indexer decode fp8", "*fp8e4nv", True),
                            ("dsa_indexer prefill bf16", "*bf16", False)):
        ptrs = {"Q": qk, "K": qk, "KS": "*fp32", "W": "*fp32", "BT": "*i32", "TOK2REQ": "*i32", "KSTART": "*i32",
                "KLEN": "*i32", "O": "*fp32"}
        consts = dict(H=64, D=128, PAGE_SIZE=64 if paged else 1, BLOCK_H=64, BLOCK_D=128, BLOCK_N=ix.block_n,
                      PAGED=paged, HAS_SCALE=qk == "*fp8e4nv", F32DOT=False)
        specs.append(KernelSpec(name, indexer_logits_kernel, ptrs, consts, ix.num_warps, ix.num_stages))
    topk_ptrs = {"S": "*fp32", "LEN": "*i32", "OUT": "*i32", "STATS": "*i32", "CKEY": "*i32", "CIDX": "*i32"}
    specs.append(KernelSpec("topk radix", radix_topk_kernel, topk_ptrs, dict(BLOCK=tk.block, NUM_BINS=GVR_BINS),
                            tk.num_warps, 1))
    specs.append(KernelSpec("topk gvr", gvr_topk_kernel, topk_ptrs,
                            dict(BLOCK=tk.block, SAMPLE=GVR_SAMPLE, NUM_BINS=GVR_BINS, HAS_STATS=False),
                            tk.num_warps, 1))
    return specs


def main(argv: list[str] | None = None) -> int:
    """Print the DSA AOT resource table (markdown, or JSON with ``--json``)."""
    return triton_compile.main(argv, dsa_specs, prog="python -m kvsieve.kernels.aot.dsa_report")


if __name__ == "__main__":
    raise SystemExit(main())
