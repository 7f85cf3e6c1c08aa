"""What the shared prefill saves: one ``kvsieve eval`` preset run twice in one process, every run
with its own prefill (``share_prefill: false``, the cost before sharing) and then sharing each
prompt's dense prefill with every run that selects only while decoding (the default), the model
loaded once. Prints each sweep's wall time and prefill count, the CPU and the load averages around
each, and checks that both sweeps wrote the same summary.csv (sharing changes no result).

    python benchmarks/eval_shared_prefill.py [--preset quick] [--set KEY=VALUE ...] [--out DIR]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the benchmarks package

from benchmarks._timing import cpu_isa, load_averages  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="quick", help="a kvsieve eval preset (kvsieve list presets)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="a config override, as kvsieve eval")
    ap.add_argument("--out", default=None, help="output folder of both sweeps (default: a temporary one)")
    args = ap.parse_args(argv)

    from kvsieve.eval.config import load_config
    from kvsieve.eval.model import load_model
    from kvsieve.eval.runner import run_sweep
    from kvsieve.integrations.transformers import KvsieveSession

    out = Path(args.out or tempfile.mkdtemp(prefix="shared_prefill_"))
    cfg = load_config(preset=args.preset, overrides=args.overrides)
    lm = load_model(cfg.model)
    prefills: list[int] = []
    real = KvsieveSession.prefill

    def counted(self: KvsieveSession, *a: object, **k: object) -> object:
        prefills.append(1)
        return real(self, *a, **k)

    print(f"CPU {cpu_isa()}; preset {args.preset} {' '.join(args.overrides)}; model {lm.name}")
    results: dict[str, dict[str, float]] = {}
    KvsieveSession.prefill = counted  # type: ignore[method-assign]
    try:
        for label, share in (("own prefill per run", False), ("shared prefill", True)):
            prefills.clear()
            load0 = load_averages()
            t0 = time.perf_counter()
            run = load_config(preset=args.preset, overrides=[*args.overrides, f"share_prefill={str(share).lower()}",
                                                             f"output_dir={out / ('shared' if share else 'own')}"])
            run_sweep(run, loaded=lm, progress=False, log=lambda _: None)
            seconds = time.perf_counter() - t0
            results[label] = {"seconds": seconds, "prefills": len(prefills)}
            print(f"{label:>20}: {seconds:7.1f} s, {len(prefills)} prefills; load (1, 5, 15 min) {load0} -> "
                  f"{load_averages()}")
    finally:
        KvsieveSession.prefill = real  # type: ignore[method-assign]
    same = (out / "own" / "summary.csv").read_bytes() == (out / "shared" / "summary.csv").read_bytes()
    ratio = results["own prefill per run"]["seconds"] / results["shared prefill"]["seconds"]
    print(f"summary.csv equal: {same}; shared is {ratio:.2f}x faster; outputs under {out}")
    if not same:
        raise SystemExit("the two sweeps' summary.csv differ")
    return results


if __name__ == "__main__":
    main()
