"""Compile-only resource report of the kvsieve CuTe-DSL kernels (no GPU needed).

``python -m kvsieve.kernels.cute.report [--json] [--jobs N]`` compiles every shipped variant
for sm_90a and sm_100a (child processes, see ``_common.compile_variant``) and prints registers,
stack/local (spill) bytes, dynamic shared memory against the 227 KiB limit, and the MMA
instructions found in the PTX. Representative shapes: MLA 512 + 64 latent with 128 heads (bf16
and FP8 656-byte cache), GQA head_dim 128 with 8 KV heads x group 16.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from ._common import SMEM_LIMIT, CompileReport, compile_variant

BLOCK_N = {"sm90": 64, "sm100": 32}


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


def compile_all(out_dir: str | None = None, jobs: int = 2) -> list[CompileReport]:
    """Compile all variants (``jobs`` child processes at a time)."""
    root = out_dir or tempfile.mkdtemp(prefix="kvsieve_cute_report_")
    specs = variants()
    with ThreadPoolExecutor(max_workers=jobs) as ex:
        futs = [ex.submit(compile_variant, s, f"{root}/{s['kind']}_{s['arch']}") for s in specs]
        return [f.result() for f in futs]


def table(reports: list[CompileReport]) -> str:
    """Markdown table of the reports."""
    rows = ["| kernel | arch | regs | stack B | local B | dyn smem B (limit 232448) | MMA "
            "(PTX) | compile s |", "|---|---|---|---|---|---|---|---|"]
    for r in reports:
        mma = ", ".join(f"{n} x `{k}`" for k, n in sorted(r.mma_instructions.items()))
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
