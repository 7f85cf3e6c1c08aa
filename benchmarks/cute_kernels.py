"""Benchmark of the CuTe-DSL sparse decode kernels (needs an SM90/SM100 GPU).

``python benchmarks/cute_kernels.py [--batch 64] [--topk 2048] [--heads 128]`` times sparse MLA
decode (bf16 and FP8 cache) and block-sparse GQA decode beside the Triton kernels and FlashMLA
(when ``flash_mla`` is installed, FP8 cache), and prints TFLOP/s and GB/s against the device
peak. On a machine without such a GPU it says so and exits 0. Where nvidia-cutlass-dsl is not
installed, ``KVSIEVE_CUTE_AOT=<bundle>`` times the kernels of an ahead-of-time bundle
(``kvsieve.kernels.aot.cute_bundle``; its MLA variants are built for these default shapes). ``--json PATH``
writes the rows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

# bf16 FLOP/s (sm90: the 8192^3 bf16 matmul rate measured on an H200), HBM B/s (datasheet)
PEAKS = {"sm90": (790e12, 4.8e12), "sm100": (2250e12, 8.0e12)}


def _time(fn, iters: int = 20) -> float:
    import torch
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e-3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--kv-len", type=int, default=8192)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import torch
    from kvsieve.kernels.common.cute import cute_available, detect_arch
    arch = detect_arch("cuda") if torch.cuda.is_available() else None
    ok, why = cute_available()
    if arch is None or not (ok or os.environ.get("KVSIEVE_CUTE_AOT")):
        print(f"cute_kernels benchmark needs an SM90/SM100 GPU and nvidia-cutlass-dsl "
              f"({why or 'no such GPU here'}); nothing to do.")
        return 0
    from kvsieve.kernels.sparse_mla_decode.cute import sparse_mla_decode_slots
    from kvsieve.kernels.sparse_mla_decode.fp8 import quantize_fp8_mla
    from kvsieve.kernels.sparse_mla_decode.triton import sparse_mla_decode
    peak_flops, peak_bw = PEAKS[arch]
    b, h, k, page = a.batch, a.heads, a.topk, a.page
    pages = -(-a.kv_len // page)
    nb = b * pages + 1
    latent = torch.randn(nb, page, 576, device="cuda").bfloat16()
    fp8 = quantize_fp8_mla(latent)
    q = (torch.randn(b, h, 576, device="cuda") * 0.3).bfloat16()
    bt = (1 + torch.arange(b * pages, device="cuda")).view(b, pages).int()
    local = torch.stack([torch.randperm(a.kv_len, device="cuda")[:k].sort().values
                         for _ in range(b)]).int()
    slots = (bt.gather(1, (local // page).long()) * page + local % page).int()
    flops = 2 * b * h * k * (576 + 512)
    rows = [("cute mla bf16", lambda: sparse_mla_decode_slots(q, latent, slots), b * k * 1152),
            ("cute mla fp8", lambda: sparse_mla_decode_slots(q, fp8, slots), b * k * 656)]
    t2r = torch.arange(b, device="cuda", dtype=torch.int32)
    lens = torch.full((b,), a.kv_len, device="cuda", dtype=torch.int32)
    off = (torch.arange(b + 1, device="cuda") * k).int()
    idx = local.reshape(1, -1).contiguous()
    rows.append(("triton mla bf16", lambda: sparse_mla_decode(q, latent, bt, t2r, lens, idx,
                                                              off, 512), b * k * 1152))
    try:
        import flash_mla
        meta = flash_mla.get_mla_metadata()[0]
        kc = fp8.view(nb, page, 1, 656)
        rows.append(("flashmla fp8", lambda: flash_mla.flash_mla_with_kvcache(
            q.view(b, 1, h, 576), kc, None, None, 512, meta, None, is_fp8_kvcache=True,
            indices=slots.view(b, 1, k)), b * k * 656))
    except Exception as e:  # not installed or interface differs
        print(f"(FlashMLA not timed: {type(e).__name__}: {e})")
    print(f"arch {arch}: batch {b}, heads {h}, topk {k}, page {page}")
    print("| kernel | time us | TFLOP/s | % peak | GB/s | % peak |\n|---|---|---|---|---|---|")
    results = []
    for name, fn, nbytes in rows:
        try:
            t = _time(fn)
        except Exception as e:
            print(f"| {name} | failed: {type(e).__name__}: {e} | | | | |")
            results.append({"kernel": name, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        results.append({"kernel": name, "shape": f"b={b} heads={h} topk={k} page={page}", "ms": t * 1e3,
                        "gb_s": nbytes / t / 1e9, "pct_hbm": 100 * nbytes / t / peak_bw,
                        "tflops": flops / t / 1e12, "pct_flops": 100 * flops / t / peak_flops})
        print(f"| {name} | {t * 1e6:.1f} | {flops / t / 1e12:.1f} | "
              f"{100 * flops / t / peak_flops:.1f} | {nbytes / t / 1e9:.0f} | "
              f"{100 * nbytes / t / peak_bw:.1f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"arch": arch, "hbm_peak_tb_s": peak_bw / 1e12, "bf16_peak_tflops": peak_flops / 1e12,
                       "rows": results}, f, indent=1)
    return 1 if any("error" in r for r in results if not r["kernel"].startswith("flashmla")) else 0


if __name__ == "__main__":
    sys.exit(main())
