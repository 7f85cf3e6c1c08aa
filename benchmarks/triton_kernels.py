"""Benchmark the kvsieve Triton kernels on a GPU: TFLOP/s and GB/s of gathered KV bytes.

``python -m benchmarks.triton_kernels [--quick] [--json PATH]``. Targets: GQA decode >= 80% of
HBM bandwidth on gathered bytes; MLA decode >= 300 TFLOP/s on H100/H200. The run first measures
its own ceilings (a device-to-device copy counting bytes read + written, an 8192^3 bf16 matmul on
random data) and prints them beside the datasheet/measured peaks it divides by (H200: 4.8 TB/s,
790 TFLOP/s, the bf16 matmul rate measured on such a machine). ``--json`` writes every row. On a
machine without a GPU it prints that it needs one and exits 0 without figures.
"""
from __future__ import annotations

import argparse
import importlib.util
import json

import torch

# (HBM bytes/s, bf16 FLOP/s): datasheet bandwidth; H200 FLOP/s is the measured bf16 matmul rate
PEAKS = {"H100": (3.35e12, 989e12), "H200": (4.8e12, 790e12), "B200": (8.0e12, 2250e12)}
GQA_TARGET_BW = 0.80
MLA_TARGET_TFLOPS = 300.0


def _peak(name: str) -> tuple[float, float]:
    for key, val in PEAKS.items():
        if key in name:
            return val
    return PEAKS["H100"]


def _bench(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=50) * 1e-3


def measure_ceilings(dev) -> tuple[float, float]:
    """(copy bytes/s read + written, bf16 matmul FLOP/s) measured on this device, random data."""
    src = torch.empty(2 ** 30, dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(src)
    copy_s = _bench(lambda: dst.copy_(src))
    del src, dst
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    mm_s = _bench(lambda: a @ b)
    return 2 * 2 ** 30 / copy_s, 2 * 8192 ** 3 / mm_s


def _row(kernel: str, shape: str, t: float, nbytes: float, flops: float, bw_peak: float,
         fl_peak: float) -> dict:
    return {"kernel": kernel, "shape": shape, "ms": t * 1e3, "gb_s": nbytes / t / 1e9,
            "pct_hbm": 100 * nbytes / t / bw_peak, "tflops": flops / t / 1e12, "pct_flops": 100 * flops / t / fl_peak}


def _paged(batch: int, ctx: int, page: int, hkv: int, dim: int, dev) -> tuple:
    n_pages = -(-ctx // page)
    bt = torch.arange(1, batch * n_pages + 1, dtype=torch.int32, device=dev).view(batch, n_pages)
    pool = torch.randn(batch * n_pages + 1, 2, hkv, page, dim, device=dev, dtype=torch.bfloat16)
    kl = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    return bt, pool[:, 0], pool[:, 1], kl


def _topk(batch: int, heads: int, ctx: int, topk: int, dev) -> tuple:
    idx = torch.sort(torch.rand(heads, batch, ctx, device=dev).argsort(-1)[..., :topk], -1)
    idx = idx.values.to(torch.int32).reshape(heads, batch * topk)
    off = torch.arange(0, batch * topk + 1, topk, dtype=torch.int32, device=dev)
    return idx, off


def bench_gqa(batches, contexts, topks, bw_peak, fl_peak, dev) -> list[dict]:
    from kvsieve.kernels.sparse_gqa_decode.triton import sparse_gqa_decode
    hkv, group, dim, page = 8, 4, 128, 64
    print(f"GQA decode ({hkv} KV heads x {group}, D={dim}, bf16, page {page}); "
          f"target >= {GQA_TARGET_BW:.0%} HBM on gathered bytes")
    print("batch  ctx     topk  ms      GB/s    %HBM   TFLOP/s")
    rows = []
    for b in batches:
        for ctx in contexts:
            bt, k, v, kl = _paged(b, ctx, page, hkv, dim, dev)
            q = torch.randn(b, hkv * group, dim, device=dev, dtype=torch.bfloat16)
            tok = torch.arange(b, dtype=torch.int32, device=dev)
            for topk in topks:
                idx, off = _topk(b, hkv, ctx, topk, dev)
                t = _bench(lambda: sparse_gqa_decode(q, k, v, bt, tok, kl, idx, off))
                gathered = b * hkv * topk * 2 * dim * 2
                flops = 2 * b * hkv * group * topk * 2 * dim
                print(f"{b:<6} {ctx:<7} {topk:<5} {t * 1e3:<7.3f} {gathered / t / 1e9:<7.0f} "
                      f"{gathered / t / bw_peak:<6.0%} {flops / t / 1e12:.1f}")
                rows.append(_row("sparse_gqa_decode", f"b={b} ctx={ctx} topk={topk}", t, gathered, flops,
                                 bw_peak, fl_peak))
    return rows


def bench_mla(batches, contexts, bw_peak, fl_peak, dev) -> list[dict]:
    from kvsieve.kernels.sparse_mla_decode.triton import sparse_mla_decode
    heads, topk, page = 128, 2048, 64
    print(f"MLA decode ({heads} heads, 512+64, topk {topk}, bf16); "
          f"target >= {MLA_TARGET_TFLOPS:.0f} TFLOP/s")
    print("batch  ctx     ms      GB/s    TFLOP/s  %peak")
    rows = []
    for b in batches:
        for ctx in contexts:
            n_pages = -(-ctx // page)
            bt = torch.arange(1, b * n_pages + 1, dtype=torch.int32, device=dev).view(b, -1)
            lat = torch.randn(b * n_pages + 1, page, 576, device=dev, dtype=torch.bfloat16)
            q = torch.randn(b, heads, 576, device=dev, dtype=torch.bfloat16)
            tok = torch.arange(b, dtype=torch.int32, device=dev)
            kl = torch.full((b,), ctx, dtype=torch.int32, device=dev)
            idx, off = _topk(b, 1, ctx, topk, dev)
            t = _bench(lambda: sparse_mla_decode(q, lat, bt, tok, kl, idx, off, 512, 0.07))
            gathered = b * topk * 576 * 2
            flops = 2 * b * heads * topk * (576 + 512)
            print(f"{b:<6} {ctx:<7} {t * 1e3:<7.3f} {gathered / t / 1e9:<7.0f} "
                  f"{flops / t / 1e12:<8.1f} {flops / t / fl_peak:.0%}")
            rows.append(_row("sparse_mla_decode", f"b={b} ctx={ctx} topk={topk}", t, gathered, flops,
                             bw_peak, fl_peak))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the process exit status."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--json", default=None, help="write the ceilings and every row here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/triton_kernels.py needs a CUDA GPU; none found, no figures printed.")
        return 0
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    bw_peak, fl_peak = _peak(name)
    print(f"device: {name}; peaks {bw_peak / 1e12:.2f} TB/s, {fl_peak / 1e12:.0f} TFLOP/s bf16")
    copy_bw, mm_flops = measure_ceilings(dev)
    print(f"measured here: copy {copy_bw / 1e12:.2f} TB/s, bf16 matmul {mm_flops / 1e12:.0f} TFLOP/s")
    for lib in ("flashinfer", "flash_mla"):
        found = importlib.util.find_spec(lib) is not None
        print(f"{lib}: {'importable (not timed here)' if found else 'not installed'}")
    batches = [1, 32] if args.quick else [1, 8, 32, 128, 256]
    contexts = [4096, 32768] if args.quick else [4096, 16384, 65536, 131072]
    topks = [256, 2048] if args.quick else [256, 512, 1024, 2048]
    rows = bench_gqa(batches, contexts, topks, bw_peak, fl_peak, dev)
    rows += bench_mla(batches, contexts, bw_peak, fl_peak, dev)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "hbm_peak_tb_s": bw_peak / 1e12, "bf16_peak_tflops": fl_peak / 1e12,
                       "copy_tb_s": copy_bw / 1e12, "matmul_tflops": mm_flops / 1e12, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
