"""Mass recall of each selector against its own ceiling, on held-out text of a real model.

For each held-out window (:mod:`.text_corpus`: the essays the indexer never trained on) of
``length`` tokens, the model runs once; on each selected layer the last ``rows`` query positions
and every key are captured as the attention receives them. Per query row and density ``1/d``
(budget ``length // d`` tokens) each selector's choice is computed from those tensors, by the
rule of the kvsieve selector of the same name at the recipes preset's settings:

* ``oracle_topk``: the exact top tokens of the dense mass summed over each KV group;
* ``oracle_page``: ``oracle_topk`` with ``block_size = page_size``, the top pages by dense mass;
* ``quest``: pages ranked by the group-averaged softmax of Quest's bound
  ``sum_d max(q_d min_d, q_d max_d)`` (bf16 min/max summaries), the newest page forced;
* ``block_select``: ``scoring: summary``, blocks ranked by the group's largest bound (fp32
  summaries), the last block forced;
* ``streaming``: 4 sinks and the most recent tokens;
* ``dsa``: the top tokens of the distilled indexer's logits (index keys rounded to bf16, as the
  preset's ``index_k_dtype``), one set for every head.

The recall of a row is the dense attention mass (per KV group: summed over its query heads,
divided by the group size) on the chosen positions, averaged over KV heads; a window's value is
the mean over its rows and layers. ``tests/dsa/test_mass_recall.py`` checks each rule against
the selector itself run through :class:`kvsieve.Engine`.

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
from ..selectors.dsa.distill import indexer_row_logits
from ..selectors.dsa.distill_targets import cached_capture, trainable_layers
from ..selectors.dsa.projections import IndexerProjections, load_projections
from ..sparse.prepare import LayerCapture
from .attention_capture import capture_attention
from .text_corpus import corpus_documents

__all__ = ["SELECTORS", "PAGE_SELECTORS", "select", "group_mass", "bound_terms", "window_recall", "mean_interval", "main"]

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


def _page_bounds(q: torch.Tensor, k: torch.Tensor, page: int, dtype: torch.dtype) -> torch.Tensor:
    """``[Hkv, G, pages]``: Quest's bound of each query head on each page's min/max (in ``dtype``)."""
    n = -(-k.shape[0] // page)
    pad = n * page - k.shape[0]
    kp = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad), value=float("nan")).view(n, page, *k.shape[1:])
    kmin = kp.nan_to_num(float("inf")).amin(1).to(dtype).float()  # [n, Hkv, D]
    kmax = kp.nan_to_num(float("-inf")).amax(1).to(dtype).float()
    qg = q.view(k.shape[1], -1, q.shape[-1])  # [Hkv, G, D]
    lo = torch.einsum("hgd,nhd->hgnd", qg, kmin)
    hi = torch.einsum("hgd,nhd->hgnd", qg, kmax)
    return torch.maximum(lo, hi).sum(-1)


def _top(score: torch.Tensor, count: int) -> torch.Tensor:
    return torch.sort(score, descending=True, stable=True).indices[: min(count, score.shape[0])]


def _pages_to_tokens(pages: torch.Tensor, page: int, length: int) -> torch.Tensor:
    return (pages[:, None] * page + torch.arange(page)).flatten().clamp(max=length - 1).unique()


def select(name: str, q: torch.Tensor, k: torch.Tensor, scale: float, budget: int, *, page_size: int = 16,
           index_scores: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The positions (int64, per KV head) that selector ``name`` (module docstring) keeps for one
    query ``q [Hq, D]`` over the keys it sees, ``k [L, Hkv, D]``; ``index_scores [L]`` are the
    indexer logits ``dsa`` ranks by."""
    length, hkv = k.shape[0], k.shape[1]
    if budget >= length:
        return [torch.arange(length)] * hkv
    pages = budget // page_size
    if name == "oracle_topk":
        return [_top(m, budget) for m in group_mass(q, k, scale)]
    if name == "oracle_page":
        mass = group_mass(q, k, scale)
        mass = torch.nn.functional.pad(mass, (0, -length % page_size)).view(hkv, -1, page_size).sum(-1)
        return [_pages_to_tokens(_top(m, pages), page_size, length) for m in mass]
    if name in PAGE_SELECTORS:
        if name == "quest":
            score = torch.softmax(_page_bounds(q, k, page_size, torch.bfloat16) * scale, -1).mean(1)
        else:
            score = (_page_bounds(q, k, page_size, torch.float32) * scale).amax(1)
        score[:, -1] = float("inf")  # the newest page / last block is forced
        return [_pages_to_tokens(_top(s, pages), page_size, length) for s in score]
    if name == "streaming":
        return [torch.cat([torch.arange(NUM_SINK), torch.arange(length - (budget - NUM_SINK), length)])] * hkv
    if name == "dsa":
        if index_scores is None:
            raise ValueError("select: 'dsa' needs index_scores (the indexer logits of the row)")
        return [_top(index_scores, budget)] * hkv
    raise ValueError(f"select: unknown selector {name!r}; known: {list(SELECTORS)}")


def _ranks(x: torch.Tensor) -> torch.Tensor:
    return x.argsort(-1).argsort(-1).float()


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([_ranks(a), _ranks(b)]))[0, 1])


def bound_terms(q: torch.Tensor, k: torch.Tensor, scale: float, page_size: int = 16, density: int = 16
                ) -> dict[str, float]:
    """Why Quest's bound ranks one query's pages as it does. The bound splits exactly into
    ``center = q . (min + max) / 2`` and ``spread = sum_d |q_d| (max_d - min_d) / 2`` (fp32 summaries
    of the complete pages). Means over the query heads: the standard deviation across pages of
    each term (times ``scale``, in logits), the Spearman correlation of the bound, the center and
    the spread with the page's dense mass (its KV group's), and the overlap of the bound's top
    ``pages / density`` pages with the mass's."""
    n = k.shape[0] // page_size
    kp = k[: n * page_size].view(n, page_size, *k.shape[1:])
    center, half = (kp.amax(1) + kp.amin(1)) / 2, (kp.amax(1) - kp.amin(1)) / 2  # [n, Hkv, D]
    mass = torch.nn.functional.pad(group_mass(q, k, scale), (0, -k.shape[0] % page_size))
    mass = mass.view(k.shape[1], -1, page_size).sum(-1)[:, :n]  # [Hkv, n]
    g, top = q.shape[0] // k.shape[1], max(n // density, 1)
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


def window_recall(caps: dict[int, LayerCapture], rows: torch.Tensor, densities: tuple[int, ...],
                  projections: dict[int, IndexerProjections] | None, length: int, page_size: int = 16
                  ) -> dict[str, dict[int, dict[int, float]]]:
    """``{selector: {density: {layer: recall}}}`` of one window, each the mean over ``rows``
    (``dsa`` only with ``projections``)."""
    names = [n for n in SELECTORS if n != "dsa" or projections is not None]
    out: dict[str, dict[int, dict[int, float]]] = {n: {d: {} for d in densities} for n in names}
    for layer, cap in caps.items():
        index = None
        if projections is not None:
            with torch.no_grad():
                index = indexer_row_logits(projections[layer], cap.hidden, rows, torch.bfloat16)
        for d in densities:
            kept = {n: [] for n in names}
            for r, t in enumerate(rows.tolist()):
                k = cap.k[: t + 1]
                mass = group_mass(cap.q[r], k, cap.scale)
                for n in names:
                    sel = select(n, cap.q[r], k, cap.scale, length // d, page_size=page_size,
                                 index_scores=None if index is None else index[r, : t + 1])
                    kept[n].append(sum(float(mass[h, s].sum()) for h, s in enumerate(sel)) / len(sel))
            for n in names:
                out[n][d][layer] = sum(kept[n]) / len(kept[n])
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
    ap.add_argument("--densities", type=int, nargs="+", default=[4, 16, 64])
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
        per_window.append(window_recall(caps, rows, tuple(args.densities), projs, args.length))
        for layer, cap in caps.items():
            for r, t in enumerate(rows.tolist()):
                for key, v in bound_terms(cap.q[r], cap.k[: t + 1], cap.scale).items():
                    bounds.setdefault(layer, {}).setdefault(key, []).append(v)
        emit(f"window {j + 1}/{args.texts} done")
    table = {n: {d: [sum(w[n][d].values()) / len(layers) for w in per_window] for d in args.densities}
             for n in per_window[0]}
    emit(f"{lm.name}, {args.length} tokens, layers {layers}, n = {args.texts} held-out windows x {args.rows} rows")
    emit("| selector | " + " | ".join(f"1/{d}" for d in args.densities) + " | of its ceiling at " +
         " / ".join(f"1/{d}" for d in args.densities) + " |")
    emit("|---|" + "---|" * (len(args.densities) + 1))
    for n, by_d in table.items():
        ceiling = "oracle_page" if n in PAGE_SELECTORS else "oracle_topk" if n == "dsa" else None
        cells = [f"{m:.3f} ± {h:.3f}" for m, h in map(mean_interval, by_d.values())] if args.texts > 1 else \
            [f"{v[0]:.3f} (n = 1)" for v in by_d.values()]
        ratio = " / ".join(f"{sum(by_d[d]) / sum(table[ceiling][d]):.2f}" for d in args.densities) if ceiling else ""
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
