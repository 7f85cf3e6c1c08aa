"""Top-k engines vs ``torch.topk``: ``python -m benchmarks.topk [--quick] [--rows N] [--k K]``.

Rows of 4K..128K fp32 scores (DSA indexer logits), k = 2048 by default. On CPU: the ``torch``
engine (``torch.topk`` over the valid prefix + ``-1`` padding) and the vectorized radix reference
against bare ``torch.topk``, as a ratio measured in the same run (the Triton kernels only run
under the interpreter there, which says nothing about speed). On a CUDA GPU: the Triton
``radix``/``gvr`` kernels (and ``cute_gvr`` when the dispatch allows it) against ``torch.topk``
and FlashInfer's ``top_k`` when installed, with CUDA-event timing. Returns a JSON-able dict.
"""
from __future__ import annotations

import argparse
import importlib.util

import torch

from kvsieve.kernels.topk import naive, plan

from ._timing import fmt_ms, measure

__all__ = ["main", "run"]


def _gpu_ms(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _engines(dev: torch.device, k: int, rows: int) -> dict:
    if dev.type != "cuda":
        return {"torch engine": lambda s, n: naive.torch_topk(s, n, k),
                "radix reference": lambda s, n: naive.radix_topk(s, n, k)}
    out = {}
    for name in ("radix", "gvr", "auto"):
        try:
            d = plan.choose_topk_engine(name, device=dev, index_topk=k)
        except ValueError:
            continue
        ws = plan.TopKWorkspace(d, rows, dev)
        out[f"{name} ({d.engine})"] = lambda s, n, ws=ws: plan.run_topk(ws, s, n)
    if importlib.util.find_spec("flashinfer") is not None:
        import flashinfer

        out["flashinfer.top_k"] = lambda s, n: flashinfer.top_k(s, k)
    return out


def run(quick: bool = False, rows: int = 64, k: int = 2048, device: str | None = None) -> dict:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    widths = (4096, 16384) if quick else (4096, 16384, 65536, 131072)
    rows = 4 if quick else rows
    res = {"device": str(dev), "rows": rows, "k": k, "results": []}
    g = torch.Generator(device=dev).manual_seed(0)
    for width in widths:
        scores = torch.randn(rows, width, generator=g, device=dev)
        lens = torch.full((rows,), width, dtype=torch.int32, device=dev)
        entry = {"width": width}
        if dev.type == "cuda":
            entry["torch.topk_ms"] = _gpu_ms(lambda: scores.topk(k, dim=1))
            for name, fn in _engines(dev, k, rows).items():
                entry[f"{name}_ms"] = _gpu_ms(lambda fn=fn: fn(scores, lens))
                entry[f"{name}_speedup"] = entry["torch.topk_ms"] / entry[f"{name}_ms"]
        else:
            base = measure(lambda: scores.topk(k, dim=1), budget_s=0.3 if quick else 1.0)
            entry["torch.topk_ms"] = base.median_s * 1e3
            for name, fn in _engines(dev, k, rows).items():
                t = measure(lambda fn=fn: fn(scores, lens), budget_s=0.3 if quick else 1.0)
                entry[f"{name}_ms"] = t.median_s * 1e3
                entry[f"{name}_vs_torch.topk"] = t.median_s / base.median_s
        res["results"].append(entry)
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.topk", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="two small widths, 4 rows")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    res = run(args.quick, args.rows, args.k, args.device)
    print(f"top-k, {res['rows']} rows, k={res['k']}, {res['device']}")
    for e in res["results"]:
        cols = [f"{key}={fmt_ms(v / 1e3) if key.endswith('_ms') else f'{v:.2f}x'}" for key, v in e.items()
                if key != "width"]
        print(f"  width {e['width']:>6}: " + ", ".join(cols))
    return res


if __name__ == "__main__":
    main()
