"""Mass recall of each selector against its own ceiling, on held-out text of a real model.

For each held-out window (:mod:`.text_corpus`: the essays the indexer never trained on) of
``length`` tokens, the model runs once; on each selected layer the last ``rows`` query positions
and every key are captured as the attention receives them. Per query row and density ``1/d``
(reduction factor ``d``) each selector's choice is the kvsieve selector's own, run on those tensors
(:func:`.selection_driver.kept_positions`) at the recipes preset's settings, its budget ``1/d``
of the window lowered onto its declared knob (:func:`kvsieve.sparse.lower_budget`:
``ceil(length / d)`` tokens in whole pages or blocks; a density below one page is refused):

* ``oracle_topk``: the exact top tokens of the dense mass summed over each KV group;
* ``oracle_page``: ``oracle_topk`` with ``block_size = page_size``, the top pages by dense mass;
* ``quest``: pages of ``page_size`` ranked by Quest's bound (bf16 min/max summaries);
* ``block_select``: ``scoring: summary``, blocks of ``page_size`` ranked by their bound (fp32
  summaries), the last block forced;
* ``streaming``: 4 sinks and the most recent tokens;
* ``dsa``: the distilled indexer's top tokens (index keys in bf16, the preset's ``index_k_dtype``).

The recall of a row is the dense attention mass (per KV group: summed over its query heads,
divided by the group size) on the chosen positions, averaged over KV heads; a window's value is
the mean over its rows and layers. ``tests/dsa/test_mass_recall.py`` checks the figures against
each selector's rule computed by hand.

    python -m kvsieve.eval.mass_recall --model gemma3-270m --length 8192 --texts 10 \\
        --projections gemma-indexer.pt --json recall.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..selectors.common.text_windows import split_documents, token_windows
from ..selectors.dsa.distill_targets import cached_capture, trainable_layers
from ..selectors.dsa.projections import IndexerProjections, load_projections
from ..sparse import SparseAttentionConfig, get_selector_class, lower_budget
from ..sparse.calibration import LayerCapture
from .attention_capture import capture_attention
from .selection_driver import kept_positions
from .text_corpus import corpus_documents

__all__ = ["SELECTORS", "PAGE_SELECTORS", "recall_config", "group_mass", "bound_terms", "window_recall",
           "mean_interval", "main"]

SELECTORS = ("oracle_topk", "oracle_page", "quest", "block_select", "streaming", "dsa")
PAGE_SELECTORS = ("quest", "block_select")
NUM_SINK = 4
#: Student t quantiles (two-sided 95 %) for n - 1 degrees of freedom, n = 2..30
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045]


def group_mass(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 ``[Hkv, L]``: the softmax of one query ``q [Hq, D]`` over ``k [L, Hkv, D]``, summed over
    each KV group's query heads and divided by the group size (each row sums to 1)."""
    g = q.shape[0] // k.shape[1]
    s = torch.einsum("hgd,lhd->hgl", q.view(k.shape[1], g, -1), k) * scale
    return torch.softmax(s, -1).mean(1)


def recall_config(name: str, length: int, reduction_factor: int, *, page_size: int = 16,
                  projections: IndexerProjections | None = None) -> SparseAttentionConfig:
    """The config of ``name`` (module docstring) at budget ``1/reduction_factor`` of ``length`` tokens;
    ``dsa`` takes its indexer geometry from ``projections``."""
    settings = {
        "oracle_topk": ("oracle_topk", {}),
        "oracle_page": ("oracle_topk", {"block_size": page_size}),
        "quest": ("quest", {"page_size": page_size, "summary_dtype": "bfloat16"}),
        "block_select": ("block_select", {"block_size": page_size, "init_blocks": 0, "local_blocks": 1,
                                          "score_type": "max", "scoring": "summary"}),
        "streaming": ("streaming", {"num_sink": NUM_SINK}),
    }
    if projections is not None:
        p = projections
        settings["dsa"] = ("dsa", {"index_k_dtype": "bfloat16", "n_heads": p.n_heads, "head_dim": p.head_dim,
                                   "rope_dim": p.rope_dim, "rope_interleave": p.rope_interleave,
                                   "rope_theta": float(p.rope_theta)})
    if name not in settings:
        extra = " ('dsa' needs projections)" if name == "dsa" else ""
        raise ValueError(f"recall_config: unknown selector {name!r}{extra}; known: {list(settings)}")
    selector, params = settings[name]
    budget = lower_budget(get_selector_class(selector), params, length, reduction_factor=reduction_factor)
    return SparseAttentionConfig(selector, params | budget.knob)


def _ranks(x: torch.Tensor) -> torch.Tensor:
    return x.argsort(-1).argsort(-1).float()


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([_ranks(a), _ranks(b)]))[0, 1])


def bound_terms(q: torch.Tensor, k: torch.Tensor, scale: float, page_size: int = 16, reduction_factor: int = 16
                ) -> dict[str, float]:
    """Why Quest's bound ranks one query's pages as it does. The bound splits exactly into
    ``center = q . (min + max) / 2`` and ``spread = sum_d |q_d| (max_d - min_d) / 2`` (fp32 summaries
    of the complete pages). Means over the query heads: the standard deviation across pages of
    each term (times ``scale``, in logits), the Spearman correlation of the bound, the center and
    the spread with the page's dense mass (its KV group's), and the overlap of the bound's top
    ``pages / reduction_factor`` pages with the mass's."""
    n = k.shape[0] // page_size
    kp = k[: n * page_size].view(n, page_size, *k.shape[1:])
    center, half = (kp.amax(1) + kp.amin(1)) / 2, (kp.amax(1) - kp.amin(1)) / 2  # [n, Hkv, D]
    mass = torch.nn.functional.pad(group_mass(q, k, scale), (0, -k.shape[0] % page_size))
    mass = mass.view(k.shape[1], -1, page_size).sum(-1)[:, :n]  # [Hkv, n]
    g, top = q.shape[0] // k.shape[1], max(n // reduction_factor, 1)
    acc: dict[str, list[float]] = {}
    for h in range(q.shape[0]):
        c = center[:, h // g] @ q[h] * scale
        sp = half[:, h // g] @ q[h].abs() * scale
        m = mass[h // g]
        row = {"center_std": float(c.std()), "spread_std": float(sp.std()), "rho_bound": _spearman(c + sp, m),
               "rho_center": _spearman(c, m), "rho_spread": _spearman(sp, m),
               "top_overlap": len(set((c + sp).topk(top).indices.tolist()) & set(m.topk(top).indices.tolist())) / top}
        for key, v in row.items():
            acc.setdefault(key, []).append(v)
    return {key: sum(v) / len(v) for key, v in acc.items()}


def window_recall(caps: dict[int, LayerCapture], rows: torch.Tensor, reduction_factors: tuple[int, ...],
                  projections: dict[int, IndexerProjections] | None, length: int, page_size: int = 16
                  ) -> dict[str, dict[int, dict[int, float]]]:
    """``{selector: {reduction factor: {layer: recall}}}`` of one window, each the mean over ``rows``
    (consecutive positions; ``dsa`` only with ``projections``)."""
    first, n = int(rows[0]), int(rows[-1]) + 1
    if not torch.equal(rows.cpu(), torch.arange(first, n)):
        raise ValueError(f"window_recall: rows must be consecutive positions, got {rows.tolist()}")
    names = [n for n in SELECTORS if n != "dsa" or projections is not None]
    out: dict[str, dict[int, dict[int, float]]] = {n: {d: {} for d in reduction_factors} for n in names}
    for layer, cap in caps.items():
        mass = [group_mass(cap.q[r], cap.k[: t + 1], cap.scale) for r, t in enumerate(rows.tolist())]
        proj = None if projections is None else projections[layer]
        for d in reduction_factors:
            for name in names:
                config = recall_config(name, length, d, page_size=page_size, projections=proj)
                kept = kept_positions(config, cap.q, cap.k, first, cap.scale, hidden=cap.hidden, projections=proj)
                per_row = [sum(float(m[h][kept[r, h, : m.shape[1]]].sum()) for h in range(m.shape[0])) / m.shape[0]
                           for r, m in enumerate(mass)]
                out[name][d][layer] = sum(per_row) / len(per_row)
    return out


def mean_interval(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of its two-sided 95 % Student t interval (n >= 2)."""
    n = len(values)
    if n < 2:
        raise ValueError(f"mean_interval: needs at least 2 values, got {n}")
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, _T95[min(n, len(_T95) + 1) - 2] * sd / math.sqrt(n)


def _captured(lm: Any, ids: torch.Tensor, layers: list[int], rows: torch.Tensor, path: Path | None
              ) -> dict[int, LayerCapture]:
    """:func:`capture_attention`, kept in ``path`` and read back from there when it holds the same
    tokens, layers and rows (:func:`~kvsieve.selectors.dsa.distill_targets.cached_capture`)."""
    def capture() -> dict[str, Any]:
        return {"caps": {i: dataclasses.asdict(c) for i, c in capture_attention(lm.model, ids, layers, rows).items()}}

    saved = cached_capture(path, {"ids": ids, "layers": layers, "rows": rows}, capture)
    return {int(i): LayerCapture(**c) for i, c in saved["caps"].items()}


def main(argv: list[str] | None = None, emit: Callable[[str], None] = print) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--texts", type=int, default=10, help="held-out windows (n of the intervals)")
    ap.add_argument("--rows", type=int, default=8, help="last query positions measured per window")
    ap.add_argument("--reduction-factors", type=int, nargs="+", default=[4, 16, 64],
                    help="budgets of 1/N of the window (densities 1/4, 1/16, 1/64 by default)")
    ap.add_argument("--projections", default=None, help="a distilled indexer file (adds dsa; sets the layers)")
    ap.add_argument("--layers", type=int, nargs="*", default=None, help="default: the indexer's, else full-attention")
    ap.add_argument("--holdout-every", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--captures", default=None, help="a folder keeping each window's captured tensors for reruns")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from .model import load_model

    lm = load_model(args.model)
    projs = load_projections(args.projections)[0] if args.projections else None
    layers = trainable_layers(lm.model.config, args.layers or (sorted(projs) if projs else None))
    _, held = split_documents(corpus_documents(), args.holdout_every)
    rows = torch.arange(args.length - args.rows, args.length)
    per_window = []
    bounds: dict[int, dict[str, list[float]]] = {}
    for j, ids in enumerate(token_windows(lm.tokenizer, held, args.length, args.texts)):
        caps = _captured(lm, ids, layers, rows, args.captures and Path(args.captures) / f"{lm.name}-{args.length}-{j}.pt")
        per_window.append(window_recall(caps, rows, tuple(args.reduction_factors), projs, args.length))
        for layer, cap in caps.items():
            for r, t in enumerate(rows.tolist()):
                for key, v in bound_terms(cap.q[r], cap.k[: t + 1], cap.scale).items():
                    bounds.setdefault(layer, {}).setdefault(key, []).append(v)
        emit(f"window {j + 1}/{args.texts} done")
    table = {n: {d: [sum(w[n][d].values()) / len(layers) for w in per_window] for d in args.reduction_factors}
             for n in per_window[0]}
    emit(f"{lm.name}, {args.length} tokens, layers {layers}, n = {args.texts} held-out windows x {args.rows} rows")
    emit("| selector | " + " | ".join(f"1/{d}" for d in args.reduction_factors) + " | of its ceiling at " +
         " / ".join(f"1/{d}" for d in args.reduction_factors) + " |")
    emit("|---|" + "---|" * (len(args.reduction_factors) + 1))
    for n, by_d in table.items():
        ceiling = "oracle_page" if n in PAGE_SELECTORS else "oracle_topk" if n == "dsa" else None
        cells = [f"{m:.3f} ± {h:.3f}" for m, h in map(mean_interval, by_d.values())] if args.texts > 1 else \
            [f"{v[0]:.3f} (n = 1)" for v in by_d.values()]
        ratio = " / ".join(f"{sum(by_d[d]) / sum(table[ceiling][d]):.2f}" for d in args.reduction_factors) if ceiling else ""
        emit(f"| {n} | " + " | ".join(cells) + f" | {ratio} |")
    emit("Quest's bound = center + spread (bound_terms), per layer, means over windows, rows and query heads:")
    emit("| layer | std center | std spread | rho(bound, mass) | rho(center, mass) | rho(spread, mass) | top 1/16 overlap |")
    emit("|---|---|---|---|---|---|---|")
    summary = {layer: {key: sum(v) / len(v) for key, v in terms.items()} for layer, terms in bounds.items()}
    for layer, b in summary.items():
        emit(f"| {layer} | {b['center_std']:.2f} | {b['spread_std']:.2f} | {b['rho_bound']:.2f} | "
             f"{b['rho_center']:.2f} | {b['rho_spread']:.2f} | {b['top_overlap']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": lm.name, "length": args.length, "layers": layers, "rows": args.rows,
                       "per_window": per_window, "bound_terms": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
