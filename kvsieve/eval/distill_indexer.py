"""``kvsieve distill-indexer``: give a model without a trained DSA indexer one, by DSA's dense
warm-up (DeepSeek-V3.2 tech report). The model is frozen; per layer an
:class:`~kvsieve.selectors.dsa.projections.IndexerProjections` (from the layer's attention-input
hidden state) is trained to minimise ``KL(p || softmax(I))``, where ``p`` is the layer's dense
attention averaged over its query heads and ``I`` the indexer logits.

The training is :mod:`kvsieve.selectors.dsa.distill`; here the model is loaded and handed to it
with the eval's attention capture and corpus (:func:`.calibration.model_context`), as the
``distill_indexer`` calibration step of a sweep is.

The projections go to one small file that the ``dsa`` selector loads (``DSAConfig(projections=
...)``); :func:`kvsieve.integrations.transformers.attach_dsa_indexer` feeds it the hidden states
inside a :class:`~kvsieve.integrations.transformers.KvsieveSession`.

    kvsieve distill-indexer --model smollm2 --out smollm2-indexer.pt --json curve.json

``--seq-len`` takes one length or several (``--seq-len 4096 8192 16384``): ``--num-seqs``,
``--heldout-seqs`` and ``--retrieval-seqs`` windows are cut at each length and one indexer is
trained on them all; the held-out recall is printed per length.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import time
from pathlib import Path

import torch

from ..selectors.dsa.distill import REDUCTION_FACTORS, DistillResult, collect, fit, result_meta
from ..selectors.dsa.distill_config import DistillConfig
from ..selectors.dsa.projections import save_projections
from ..terminal import plain

__all__ = ["main"]


def _print_curve(label: str, result: DistillResult) -> None:
    print(f"indexer {label}: epoch | wall s | cpu s | KL train | KL held out | mean over lengths: "
          + " | ".join(f"recall 1/{d}" for d in REDUCTION_FACTORS))
    for c in result.curve:
        print(f"{c.epoch} | {c.seconds:.0f} | {c.cpu_seconds:.0f} | {c.train_kl:.4f} | {c.heldout_kl:.4f} | "
              + " | ".join(f"{c.recall.get(d, math.nan):.4f}" for d in REDUCTION_FACTORS))
    for n, by_factor in sorted(result.curve[-1].recall_by_length.items()):
        for name, ref in (("indexer", by_factor), ("streaming (4 sinks + recent)", result.streaming_by_length[n]),
                          ("oracle (exact top-k of p)", result.oracle_by_length[n])):
            print(f"{name} held-out recall at {n}: " + " | ".join(f"1/{d} {ref[d]:.4f}" for d in REDUCTION_FACTORS))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvsieve distill-indexer", description=plain(__doc__.split("\n\n")[0]))
    ap.add_argument("--model", default="smollm2", help="smollm2 | gemma3-270m | tiny-random | a checkpoint directory")
    ap.add_argument("--out", required=True, help="where to write the projections (torch.save file)")
    ap.add_argument("--layers", type=int, nargs="*", default=None, help="default: the full-attention layers")
    for f in dataclasses.fields(DistillConfig):
        if f.name == "seq_len":
            ap.add_argument("--seq-len", type=int, nargs="+", default=[f.default], metavar="TOKENS",
                            help="window length, or several: the windows are cut at each and one indexer is "
                                 f"trained on them all (default {f.default})")
        else:
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    ap.add_argument("--grid", nargs="*", default=[], metavar="HEADSxDIM",
                    help="also train these geometries (e.g. 4x16 16x64) on the same captured windows; their "
                         "curves go to --json under 'grid' (recall against size)")
    ap.add_argument("--json", default=None, help="write the config, the curve and the split here")
    ap.add_argument("--captures", default=None, help="a folder keeping each window's captured targets for reruns")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from .model import load_model
    from .calibration import model_context

    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(DistillConfig)}
    cfg = DistillConfig(**options | {"seq_len": args.seq_len[0] if len(args.seq_len) == 1 else tuple(args.seq_len)})
    bad = [g for g in args.grid if not re.fullmatch(r"[1-9][0-9]*x[1-9][0-9]*", g)]
    if bad:
        ap.error(f"--grid: expected HEADSxDIM such as 4x16, got {bad}")
    grid = [tuple(int(x) for x in g.split("x")) for g in args.grid]
    loaded = load_model(args.model)
    corpus = collect(model_context(loaded, layers=args.layers), cfg, captures=args.captures and Path(args.captures))
    capture_cost = time.perf_counter() - corpus.start[0], time.process_time() - corpus.start[1]
    result = fit(corpus, cfg)
    meta = result_meta(result, cfg, loaded.name)
    save_projections(args.out, result.projections, meta)
    print(f"saved layers {meta['layers']} of index projections to {args.out}")
    _print_curve(f"{cfg.n_heads}x{cfg.head_dim}", result)
    meta["grid"] = []
    for heads, dim in grid:
        now = time.perf_counter() - capture_cost[0], time.process_time() - capture_cost[1]
        g_cfg = dataclasses.replace(cfg, n_heads=heads, head_dim=dim, rope_dim=min(cfg.rope_dim, dim))
        g = fit(dataclasses.replace(corpus, start=now), g_cfg)
        g_meta = result_meta(g, g_cfg, loaded.name)
        meta["grid"].append({k: g_meta[k] for k in ("n_heads", "head_dim", "rope_dim", "parameters", "curve")})
        _print_curve(f"{heads}x{dim} ({g_meta['parameters']} parameters)", g)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=2)
    return 0
