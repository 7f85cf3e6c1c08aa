"""Compile-only resource report of the kvsieve CuTe-DSL kernels (no GPU needed).

``python -m kvsieve.kernels.aot.cute_report [--json] [--jobs N]`` compiles every shipped variant
for sm_90a and sm_100a (child processes, see ``cute_compile.compile_variant``) and prints registers,
stack/local (spill) bytes, dynamic shared memory against the 227 KiB limit, and the MMA
instructions found in the PTX. Representative shapes: MLA 512 + 64 latent with 128 heads (bf16
and FP8 656-byte cache), GQA head_dim 128 with 8 KV heads x group 16; the GVR top-k
(``kvsieve.kernels.topk.cute``, no MMA) for k = 512, 1024, 2048 (same recipe).
"""
from __future__ import annotations

import argparse
import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from ..common.cute import SMEM_LIMIT
from ..common.gather.cute.host import BLOCK_N
from .cute_compile import CompileReport, compile_variant, variant_name


def variants() -> list[dict]:
    """Every shipped kernel variant, both architectures."""
    out = []
    for arch in ("sm90", "sm100"):
        bn = BLOCK_N[arch]
        for kind in ("mla", "mla_fp8"):
            out.append(dict(arch=arch, kind=kind, d_qk=576, d_v=512, dv_tile=256, group=128,
                            num_kv_heads=1, block_n=bn))
        out.append(dict(arch=arch, kind="gqa", d_qk=128, d_v=128, dv_tile=128, group=16,
                        num_kv_heads=8, block_n=bn))
    return out


def topk_variants() -> list[dict]:
    """The GVR top-k variants (one per supported k), both architectures."""
    return [dict(arch=arch, kind="topk_gvr", k=k) for arch in ("sm90", "sm100")
            for k in (512, 1024, 2048)]


def _compile(spec: dict, root: str) -> CompileReport:
    return compile_variant(spec, f"{root}/{variant_name(spec)}")


def compile_all(out_dir: str | None = None, jobs: int = 2,
                specs: list[dict] | None = None) -> list[CompileReport]:
    """Compile ``specs`` (default: every variant, attention and top-k), ``jobs`` child
    processes at a time."""
    root = out_dir or tempfile.mkdtemp(prefix="kvsieve_cute_report_")
    specs = variants() + topk_variants() if specs is None else specs
    with ThreadPoolExecutor(max_workers=jobs) as ex:
        futs = [ex.submit(_compile, s, root) for s in specs]
        return [f.result() for f in futs]


def table(reports: list[CompileReport]) -> str:
    """Markdown table of the reports."""
    rows = ["| kernel | arch | regs | stack B | local B | dyn smem B (limit 232448) | MMA "
            "(PTX) | compile s |", "|---|---|---|---|---|---|---|---|"]
    for r in reports:
        mma = ", ".join(f"{n} x `{k}`" for k, n in sorted(r.mma_instructions.items())) or \
            f"none ({r.other_counts.get('atom.shared.add', 0)} x `atom.shared.add`)"
        rows.append(f"| {r.name.rsplit('_', 1)[0]} | {r.arch} | {r.registers} | {r.stack_bytes} "
                    f"| {r.local_bytes} | {r.dynamic_smem}"
                    f"{'' if r.dynamic_smem <= SMEM_LIMIT else ' (OVER)'} | {mma} | "
                    f"{r.compile_s} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out-dir", default=None)
    a = ap.parse_args(argv)
    reps = compile_all(a.out_dir, a.jobs)
    print(json.dumps([asdict(r) for r in reps], indent=1) if a.json else table(reps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
