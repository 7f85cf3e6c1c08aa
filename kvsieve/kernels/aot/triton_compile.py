"""Compile-only driver of the Triton kernels (no GPU needed): compile kernels at given configs for
sm90/sm100 and read registers, spill bytes, shared memory, TMEM and the MMA instruction family from
Triton's own ptxas log (``TRITON_DUMP_PTXAS_LOG=1``, fresh cache) and ``metadata.shared``. Must
run without ``TRITON_INTERPRET=1``. The reports (``triton_report``, ``dsa_report``) list the
configs (:class:`KernelSpec`) and call :func:`main`.
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


def _source(spec: KernelSpec):  # the ASTSource of one config
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


def compile_report(specs: Callable[[int], list[KernelSpec]], ccs: tuple[int, ...] = (90, 100)) -> list[dict]:
    """Compile every config ``specs(cc)`` lists for each compute capability; one dict per row."""
    import triton
    from triton.backends.compiler import GPUTarget

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise ValueError("TRITON_INTERPRET: expected unset; AOT compilation needs the compiler")
    rows = []
    for cc in ccs:
        for spec in specs(cc):
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


def main(argv: list[str] | None, specs: Callable[[int], list[KernelSpec]], prog: str) -> int:
    """Print the AOT resource table of ``specs`` as markdown, or JSON with ``--json``."""
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of markdown")
    args = ap.parse_args(argv)
    rows = compile_report(specs)
    print(json.dumps(rows) if args.json else format_table(rows))
    return 0

