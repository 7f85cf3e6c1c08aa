"""AOT resource report: compile every kernel at its shipped sm90/sm100 config, no GPU needed.

``python -m kvsieve.kernels.triton.report`` prints a markdown table (``--json`` for JSON) of
registers, spill bytes, shared memory, TMEM and the MMA instruction family, read from Triton's
own ptxas log (``TRITON_DUMP_PTXAS_LOG=1``, fresh cache) and ``metadata.shared``. Must run
without ``TRITON_INTERPRET=1``. The representative shapes are bf16, GQA 8 KV heads x group 8 x
head_dim 128, MLA 512 + 64 with 128 heads, merge over 32 splits of 512 columns.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from . import launch

SMEM_LIMIT = {90: 227 * 1024, 100: 227 * 1024}
ARCH_KEY = {90: "sm90", 100: "sm100"}
FLOAT_ARGS = ("qk_scale", "threshold_scale_factor")
UNIT_STRIDES = ("stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_vd")


@dataclass(frozen=True)
class KernelSpec:
    """One kernel at one shipped configuration."""

    name: str
    fn: object
    pointers: dict[str, str]
    constexprs: dict[str, object]
    num_warps: int
    num_stages: int


def _specs(cc: int) -> list[KernelSpec]:
    from .kv_helpers.kernel import _compact_kernel
    from .merge_states.kernel import _merge_states_kernel
    from .paged_prefill.kernel import _prefill_fwd
    from .common.gather import _gather_attn_fwd

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
        KernelSpec("sparse_gqa_decode", _gather_attn_fwd, attn_ptrs, dict(gqa, SKIP=False),
                   g.num_warps, g.num_stages),
        KernelSpec("sparse_gqa_decode +skip", _gather_attn_fwd, attn_ptrs,
                   dict(gqa, SKIP=True), g.num_warps, g.num_stages),
        KernelSpec("sparse_mla_decode (split-K)", _gather_attn_fwd, split_ptrs, mla,
                   m.num_warps, m.num_stages),
        KernelSpec("paged_prefill dense", _prefill_fwd, pre_ptrs,
                   dict(GROUP=8, GROUP_PAD=8, PAGE_SIZE=64, DA=128, DB=0, DV=128,
                        BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_DA=128, BLOCK_DB=16,
                        BLOCK_DV=128, SKIP=False, COUNT=False, F32DOT=False),
                   p.num_warps, p.num_stages),
        KernelSpec("merge_states", _merge_states_kernel,
                   {"V": "*fp32", "S": "*fp32", "O": "*bf16", "LSE": "*fp32"},
                   dict(D=512, BLOCK_S=32, BLOCK_D=512), launch.MERGE_NUM_WARPS, 1),
        KernelSpec("compact_kv_", _compact_kernel,
                   {"K": "*bf16", "V": "*bf16", "BT": "*i32", "KEEP": "*i32"},
                   dict(PAGE_SIZE=64, DK=128, DV=128, BLOCK_N=launch.COMPACT_BLOCK_N[arch],
                        BLOCK_DK=128, BLOCK_DV=128, HAS_V=True), 4, 1),
    ]


def _source(spec: KernelSpec):
    from triton.compiler import ASTSource

    sig, consts, attrs = {}, dict(spec.constexprs), {}
    for i, name in enumerate(spec.fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in spec.pointers:
            sig[name] = spec.pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in UNIT_STRIDES:
            sig[name], consts[name] = "constexpr", 1
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride") and name not in ("stride_lh", "stride_ls"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=spec.fn, signature=sig, constexprs=consts, attrs=attrs)


def _mma_family(ptx: str) -> str:
    if "tcgen05.mma" in ptx:
        return "tcgen05"
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    if "mma.sync" in ptx:
        return "mma.sync"
    return "none"


def compile_report(ccs: tuple[int, ...] = (90, 100),
                   specs: Callable[[int], list[KernelSpec]] | None = None) -> list[dict]:
    """Compile every shipped kernel config for each compute capability; one dict per row.

    ``specs(cc)`` lists the configs to build (default: this package's attention kernels).
    """
    import triton
    from triton.backends.compiler import GPUTarget

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise ValueError("TRITON_INTERPRET: expected unset; AOT compilation needs the compiler")
    rows = []
    for cc in ccs:
        for spec in (specs or _specs)(cc):
            with tempfile.TemporaryDirectory() as cache:
                os.environ["TRITON_CACHE_DIR"] = cache
                os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
                buf = io.StringIO()
                with contextlib.redirect_stdout(buf):
                    k = triton.compile(_source(spec), target=GPUTarget("cuda", cc, 32),
                                       options={"num_warps": spec.num_warps,
                                                "num_stages": spec.num_stages})
            log = buf.getvalue()
            regs = re.search(r"Used (\d+) registers", log)
            spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
            rows.append(dict(
                kernel=spec.name, arch=f"sm_{cc}a", num_warps=spec.num_warps,
                num_stages=spec.num_stages, registers=int(regs.group(1)) if regs else -1,
                spill_stores=int(spill.group(1)) if spill else -1,
                spill_loads=int(spill.group(2)) if spill else -1,
                shared=int(k.metadata.shared), smem_limit=SMEM_LIMIT[cc],
                tmem=int(getattr(k.metadata, "tmem_size", 0) or 0),
                mma=_mma_family(k.asm["ptx"])))
    return rows


def format_table(rows: list[dict]) -> str:
    """Markdown table of :func:`compile_report` rows."""
    head = ("| kernel | arch | warps | stages | registers | spill st/ld (B) | shared (B) "
            "| TMEM cols | MMA |\n|---|---|---|---|---|---|---|---|---|")
    body = [f"| {r['kernel']} | {r['arch']} | {r['num_warps']} | {r['num_stages']} | "
            f"{r['registers']} | {r['spill_stores']}/{r['spill_loads']} | {r['shared']} | "
            f"{r['tmem']} | {r['mma']} |" for r in rows]
    return "\n".join([head, *body])


def main(argv: list[str] | None = None, specs: Callable[[int], list[KernelSpec]] | None = None,
         prog: str = "python -m kvsieve.kernels.triton.report") -> int:
    """Print the AOT resource table of ``specs`` (default: the attention kernels) as markdown, or
    JSON with ``--json``."""
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of markdown")
    args = ap.parse_args(argv)
    rows = compile_report(specs=specs)
    print(json.dumps(rows) if args.json else format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
