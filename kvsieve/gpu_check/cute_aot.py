"""Verify the CuTe-DSL kernels from their ahead-of-time bundle (``kvsieve.kernels.aot.cute_bundle``).

``python -m kvsieve.gpu_check.cute_aot check --bundle DIR [--json PATH]`` (no GPU needed): the
manifest is read, the library's checksum verified, the library loaded with ctypes and every
kernel's two entry points resolved; each kernel's cubin load is attempted and its CUDA error
recorded (without a GPU it is the driver error, which is the point where a GPU is needed).

``... run --bundle DIR`` (on the GPU): with ``KVSIEVE_CUTE_AOT=DIR`` the public CuTe functions
launch from the bundle; each bundled kernel is compared with its reference (bf16 MLA and GQA
against the Triton folder's ``naive``, FP8 MLA against the dequantizing reference, GVR top-k
position for position against the radix reference). Exit 0 when all agree, 1 on any mismatch,
3 when there is no bundle (the driver reports the step as skipped with that line).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

from .cases import rel_err

__all__ = ["check", "run", "main"]


def check(bundle_dir: Path) -> dict:
    """Structural check of a bundle on any machine; the per-kernel load result is recorded."""
    from ..kernels.common.cute_bundle import AotBundle
    b = AotBundle(bundle_dir)
    kernels = {}
    for key in b.keys:
        k = b.kernel(key)
        try:
            k.load()
            kernels[key] = "cubin loaded"
        except RuntimeError as e:
            kernels[key] = str(e)
    m = b.manifest
    return {"bundle": str(bundle_dir), "arch": m["arch"], "dsl_version": m["dsl_version"],
            "library_bytes": m["library_bytes"], "bundle_bytes": m["bundle_bytes"], "kernels": kernels}


def _selection(batch: int, page: int, topk: int, kv_len: int, heads: int = 1, block: int = 1):
    g = torch.Generator().manual_seed(batch * 1000 + page)
    pages = -(-kv_len // page)
    nb = batch * pages + 1
    bt = (1 + torch.randperm(nb - 1, generator=g)).view(batch, pages).int()
    n_sel = -(-kv_len // block)
    k = min(topk, n_sel)
    idx = torch.stack([torch.randperm(n_sel, generator=g)[:k].sort().values for _ in range(batch * heads)])
    idx = idx.view(batch, heads, k).transpose(0, 1).reshape(heads, -1).int().contiguous()
    idx[:, :k] = -1  # token 0 selects nothing: out 0, lse +inf
    off = (torch.arange(batch + 1) * k).int()
    return nb, bt, torch.full((batch,), kv_len, dtype=torch.int32), idx, off


def _mla(fp8: bool) -> float:
    from ..kernels.sparse_mla_decode.cute import sparse_mla_decode
    from ..kernels.sparse_mla_decode.fp8 import quantize_fp8_mla
    from ..kernels.sparse_mla_decode.naive import sparse_mla_decode as ref
    from ..kernels.sparse_mla_decode.naive import sparse_mla_decode_fp8_reference
    batch, page, heads = 3, 53, 128
    nb, bt, lens, idx, off = _selection(batch, page, 300, 2500)
    g = torch.Generator().manual_seed(3)
    latent = torch.randn(nb, page, 576, generator=g).bfloat16()
    q = (torch.randn(batch, heads, 576, generator=g) * 0.3).bfloat16()
    t2r = torch.arange(batch, dtype=torch.int32)
    cache = quantize_fp8_mla(latent) if fp8 else latent
    out, lse = sparse_mla_decode(*[x.cuda() for x in (q, cache, bt, t2r, lens, idx, off)], 512)
    if fp8:
        r_out, r_lse = sparse_mla_decode_fp8_reference(q, cache, bt, t2r, lens, idx, off)
    else:
        r_out, r_lse = ref(q, latent, bt, t2r, lens, idx, off, 512)
    return max(rel_err(out, r_out), rel_err(lse, r_lse))


def _gqa() -> float:
    from ..kernels.sparse_gqa_decode.cute import sparse_gqa_decode
    from ..kernels.sparse_gqa_decode.naive import sparse_gqa_decode as ref
    hkv, group, d, page, block = 2, 8, 128, 53, 53
    nb, bt, lens, idx, off = _selection(3, page, 7, 1000, hkv, block)
    g = torch.Generator().manual_seed(5)
    pool = torch.randn(nb, 2, hkv, page, d, generator=g).bfloat16()
    q = torch.randn(3, hkv * group, d, generator=g).bfloat16()
    args = (q, pool[:, 0], pool[:, 1], bt, torch.arange(3, dtype=torch.int32), lens, idx, off, block)
    out, lse = sparse_gqa_decode(*[a.cuda() if torch.is_tensor(a) else a for a in args])
    r_out, r_lse = ref(*args)
    return max(rel_err(out, r_out), rel_err(lse, r_lse))


def _topk(k: int) -> float:
    from ..kernels.topk.cute.host import gvr_topk
    from ..kernels.topk.naive import radix_topk
    g = torch.Generator().manual_seed(k)
    s = torch.randn(4, 9295, generator=g)
    s[1] = torch.randint(0, 5, (9295,), generator=g).float()
    lens = torch.tensor([9295, 9295, k - 1, 3000], dtype=torch.int32)
    got = gvr_topk(s.cuda(), lens.cuda(), k).cpu()
    return 0.0 if torch.equal(got, radix_topk(s, lens, k)) else math.inf


CASES = {"mla_bf16": (lambda: _mla(False), 3e-2), "mla_fp8": (lambda: _mla(True), 3e-2),
         "gqa_bf16": (_gqa, 3e-2), "topk_gvr_k512": (lambda: _topk(512), 0.0),
         "topk_gvr_k2048": (lambda: _topk(2048), 0.0)}


def run(bundle_dir: Path) -> dict:
    """Every bundled kernel against its reference on the GPU (``KVSIEVE_CUTE_AOT`` set here)."""
    os.environ["KVSIEVE_CUTE_AOT"] = str(bundle_dir)
    results = {}
    for name, (fn, tol) in CASES.items():
        try:
            err = fn()
            results[name] = {"max_err": err, "tol": tol, "passed": err <= tol}
        except Exception as e:  # a failed launch is a result, reported with its message
            results[name] = {"max_err": math.inf, "tol": tol, "passed": False,
                             "error": f"{type(e).__name__}: {e}"[:500]}
    return {"bundle": str(bundle_dir), "cases": results, "ok": all(r["passed"] for r in results.values())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvsieve.gpu_check.cute_aot", description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("check", "run"))
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    bundle = Path(a.bundle)
    if not (bundle / "manifest.json").exists():
        print(f"no CuTe AOT bundle at {bundle} (build: python -m kvsieve.kernels.aot.cute_bundle build --out {bundle})")
        return 3
    res = check(bundle) if a.action == "check" else run(bundle)
    print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    # "check" is structural: a bundle it cannot read raises; its per-kernel load results are only reported
    return 0 if a.action == "check" or res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
