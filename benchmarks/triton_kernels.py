"""Benchmark the kvsieve Triton kernels on a GPU: TFLOP/s and GB/s of gathered KV bytes.

``python benchmarks/triton_kernels.py [--quick]``. Targets: GQA decode >= 80% of HBM bandwidth
on gathered bytes; MLA decode >= 300 TFLOP/s on H100/H200. On a machine without a GPU it
prints that it needs one and exits 0 without figures.
"""
from __future__ import annotations

import argparse
import importlib.util

import torch

PEAKS = {"H100": (3.35e12, 989e12), "H200": (4.8e12, 989e12), "B200": (8.0e12, 2250e12)}
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


def bench_gqa(batches, contexts, topks, bw_peak, dev) -> None:
    from kvsieve.kernels.triton import sparse_gqa_decode
    hkv, group, dim, page = 8, 4, 128, 64
    print(f"GQA decode ({hkv} KV heads x {group}, D={dim}, bf16, page {page}); "
          f"target >= {GQA_TARGET_BW:.0%} HBM on gathered bytes")
    print("batch  ctx     topk  ms      GB/s    %HBM   TFLOP/s")
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


def bench_mla(batches, contexts, bw_peak, fl_peak, dev) -> None:
    from kvsieve.kernels.triton import sparse_mla_decode
    heads, topk, page = 128, 2048, 64
    print(f"MLA decode ({heads} heads, 512+64, topk {topk}, bf16); "
          f"target >= {MLA_TARGET_TFLOPS:.0f} TFLOP/s")
    print("batch  ctx     ms      GB/s    TFLOP/s  %peak")
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


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the process exit status."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/triton_kernels.py needs a CUDA GPU; none found, no figures printed.")
        return 0
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    bw_peak, fl_peak = _peak(name)
    print(f"device: {name}; peaks {bw_peak / 1e12:.2f} TB/s, {fl_peak / 1e12:.0f} TFLOP/s bf16")
    for lib in ("flashinfer", "flash_mla"):
        found = importlib.util.find_spec(lib) is not None
        print(f"{lib}: {'importable (not timed here)' if found else 'not installed'}")
    batches = [1, 32] if args.quick else [1, 8, 32, 128, 256]
    contexts = [4096, 32768] if args.quick else [4096, 16384, 65536, 131072]
    topks = [256, 2048] if args.quick else [256, 512, 1024, 2048]
    bench_gqa(batches, contexts, topks, bw_peak, dev)
    bench_mla(batches, contexts, bw_peak, fl_peak, dev)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
