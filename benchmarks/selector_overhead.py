"""Selector host overhead per decode step (batch 64 x 4K and batch 8 x 32K), against the attention time it saves.

For each registered selector that selects at decode (``predict_attn``): the step's selector work
(``on_append`` — e.g. RocketKV/Quest page-summary refresh — then ``predict_attn`` — page top-k,
block scoring, oracle top-k, ...) is timed on a decode batch, on inputs built fresh each step as an
engine step builds them; the ``torch`` backend is timed dense
(``params=None``) and with the selector's selection. Reported: ``overhead / (dense - sparse)``, the
fraction of the saved attention time the selector spends (< 1: selection pays for itself at this
size; one layer, same process). Selectors are configured to a comparable budget (``1/budget_inv``
of the context). ``block_select`` is timed in both scoring modes, ``exact`` (reads every key)
and ``summary`` (cached min/max keys per block), side by side. ``dsa`` runs at the eval's distilled
indexer geometry (8 heads x 32, kvsieve eval's ``distill_indexer``) from finished indexer tensors
(:class:`IndexerInputs` ``q_index``/``k_index``/``weights``; the model's projection GEMMs are not
timed), its history's index keys already in the pool. Prefill-only selectors (eviction) and the
skip-softmax threshold are listed as skipped, with the reason.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import functools
import gc
import json
import sys
from collections.abc import Callable

import torch

from kvsieve import AttentionMetadata, KVCacheManager, KVCacheSpec, available_selectors, create_selector
from kvsieve.sparse import SelectorInputs
from kvsieve.selectors.dsa.projections import IndexerInputs
from kvsieve.sparse.backends import AttentionGeometry, get_backend
from kvsieve.sparse.selection import attended_counts

from ._timing import load_average, load_averages, measure

__all__ = ["run", "main", "selector_configs"]

FULL = ({"batch": 64, "context": 4096, "hq": 8, "hkv": 2, "d": 64, "page": 64, "budget_inv": 16},
        {"batch": 8, "context": 32768, "hq": 8, "hkv": 2, "d": 64, "page": 64, "budget_inv": 16})
QUICK = ({"batch": 4, "context": 256, "hq": 4, "hkv": 2, "d": 32, "page": 16, "budget_inv": 4},)
DSA_GEOMETRY = {"n_heads": 8, "head_dim": 32, "rope_dim": 16}  # kvsieve eval's distilled indexer


SKIP_REASONS = {
    "snapkv": "prefill-only eviction: no decode-time selection",
    "skip_softmax": "a threshold read inside the attention kernel: no selection step to weigh against the saving",
}


def selector_configs(context: int, page: int, budget_inv: int) -> dict[str, list[dict]]:
    """Per-selector settings (one or more variants) giving ~``context / budget_inv`` attended tokens per query."""
    budget = context // budget_inv
    sub = min(16, page)
    blocks = {"block_size": page, "topk_blocks": max(1, budget // page)}
    return {
        "rocketkv": [{"page_size": sub, "topk": max(1, budget // sub)}],
        "quest": [{"page_size": sub, "budget": budget}],
        "block_select": [{**blocks, "scoring": "exact"}, {**blocks, "scoring": "summary"}],
        "oracle_topk": [{"budget": budget}],
        "streaming": [{"budget": budget}],
        "dsa": [{"index_topk": budget, **DSA_GEOMETRY}],
    }


def _decode_batch(cfg: dict, seed: int = 0):
    b, ctx, hkv, d, page = cfg["batch"], cfg["context"], cfg["hkv"], cfg["d"], cfg["page"]
    nb = -(-ctx // page)
    spec = KVCacheSpec(num_layers=1, num_blocks=b * nb + 1, tokens_per_block=page, num_kv_heads=hkv, head_dim=d,
                       max_requests=b, max_blocks_per_seq=nb)
    mgr = KVCacheManager(spec)
    g = torch.Generator().manual_seed(seed)
    pool = mgr.pools[0]
    for i in range(0, pool.shape[0], 512):
        pool[i: i + 512].normal_(generator=g)
    for rid in range(b):
        mgr.add_request(rid, ctx - 1)
        mgr.append_tokens(rid, 1)  # the step's new token (already in the pool: random data)
    md = AttentionMetadata(kv_cache_manager=mgr, max_num_requests=b, max_num_tokens=b,
                           translations=("ragged_page_table",))
    md.request_ids = list(range(b))
    md.seq_lens = [1] * b
    md.num_contexts = 0
    md.prepare()
    q = torch.randn(b, cfg["hq"], d, generator=g)
    k_new = torch.randn(b, hkv, d, generator=g)
    v_new = torch.randn(b, hkv, d, generator=g)
    return mgr, md, q, k_new, v_new


def run(quick: bool = False) -> dict:
    """Every shape of ``QUICK``/``FULL``: ``{"shapes": [one result per shape]}``."""
    return {"shapes": [_run_shape(cfg, 0.05 if quick else 0.4) for cfg in (QUICK if quick else FULL)],
            "load_1m_end": load_average()}


def _inputs(name: str, sel, q, k_new, v_new, md, geo, knobs: dict, seed: int = 1) -> Callable[[], SelectorInputs]:
    """A maker of the step's selector inputs (fresh ones each call, as each engine step builds
    them: the hooks' per-step scratch starts empty), with the history's state in place (the
    prefill's work): page summaries of the whole context, or DSA's index keys (random) and this
    step's finished tensors."""
    hkv = geo.num_kv_heads
    model_inputs = None
    if name == "dsa":
        g = torch.Generator().manual_seed(seed)
        b, h, d = q.shape[0], knobs["n_heads"], knobs["head_dim"]
        model_inputs = IndexerInputs(q_index=torch.randn(b, h, d, generator=g), k_index=torch.randn(b, d, generator=g),
                                     weights=torch.rand(b, h, generator=g) * (d ** -0.5 * h ** -0.5))
    make = functools.partial(SelectorInputs, q=q, k=k_new, v=v_new, metadata=md, layer_idx=0, num_kv_heads=hkv,
                             sm_scale=geo.sm_scale, rows=md.generation_rows, phases=frozenset({"generation"}),
                             model_inputs=model_inputs)
    inputs = make()
    if name == "dsa":
        k_pool, _ = sel.index_pools(inputs)
        k_pool.normal_(generator=torch.Generator().manual_seed(seed + 1))
    elif hasattr(sel, "summaries") and knobs.get("scoring", "summary") == "summary":
        lens = md.kv_lens_host.copy()
        sel.summaries(inputs).refresh(0, md.slots, lens * 0, lens)
    return make


def _run_shape(cfg: dict, budget: float) -> dict:
    mgr, md, q, k_new, v_new = _decode_batch(cfg)
    hkv, d = cfg["hkv"], cfg["d"]
    geo = AttentionGeometry(kind="gqa", num_q_heads=cfg["hq"], num_kv_heads=hkv, head_dim=d, sm_scale=d ** -0.5)
    backend = get_backend("torch")
    dense = measure(lambda: backend.forward(q, md, 0, geo, None), budget_s=budget)
    configs = selector_configs(cfg["context"], cfg["page"], cfg["budget_inv"])
    rows, skipped = [], {}
    for name in available_selectors():
        if name not in configs:
            skipped[name] = SKIP_REASONS.get(name, "not configured in this benchmark")
            continue
        for knobs in configs[name]:
            try:
                sel = create_selector(name, **knobs)
                make_inputs = _inputs(name, sel, q, k_new, v_new, md, geo, knobs)

                def step():
                    inputs = make_inputs()
                    sel.on_append(inputs)
                    return sel.predict_attn(inputs)

                params = step()
                if params is None:
                    skipped[name] = "predict_attn returned None at decode"
                    continue
                t_sel = measure(step, budget_s=budget)
                t_sparse = measure(lambda: backend.forward(q, md, 0, geo, params), budget_s=budget)
                attended = int(attended_counts(params, md.token_kv_lens, hkv).sum())
                dense_count = int(md.token_kv_lens.to(torch.int64).sum()) * hkv
                saved = dense.median_s - t_sparse.median_s
                rows.append({
                    "selector": name, "config": knobs, "selector_step": t_sel.as_dict(),
                    "sparse_attention": t_sparse.as_dict(), "dense_attention": dense.as_dict(),
                    "attended_fraction": attended / dense_count, "saved_s": saved,
                    "overhead_fraction_of_saved": t_sel.median_s / saved if saved > 0 else None,
                })
            except Exception as err:  # noqa: BLE001 - one selector failing must not sink the suite
                skipped[name] = f"{type(err).__name__}: {err}"[:300]
        gc.collect()
    del mgr
    gc.collect()
    return {"config": cfg, "dense_attention": dense.as_dict(), "selectors": rows, "skipped": skipped}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.selector_overhead", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1, as python -m benchmarks)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    argv = sys.argv[1:] if argv is None else argv
    meta = {"command": " ".join(["python -m benchmarks.selector_overhead", *argv]),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "torch_threads": torch.get_num_threads(), "loadavg_start": load_averages()}
    res = run(args.quick)
    meta["loadavg_end"] = load_averages()
    res["meta"] = meta
    print(f"{meta['command']} on {meta['date']}, torch threads {meta['torch_threads']}, load (1/5/15 min) "
          f"{meta['loadavg_start']} at start, {meta['loadavg_end']} at end")
    for shape in res["shapes"]:
        c = shape["config"]
        print(f"batch {c['batch']} x {c['context']} tokens: dense torch attention "
              f"{shape['dense_attention']['median_s'] * 1e3:.2f} ms")
        for r in shape["selectors"]:
            f = r["overhead_fraction_of_saved"]
            label = r["selector"] + (f"[{r['config']['scoring']}]" if "scoring" in r["config"] else "")
            print(f"  {label:22s} step={r['selector_step']['median_s'] * 1e3:8.2f} ms sparse="
                  f"{r['sparse_attention']['median_s'] * 1e3:8.2f} ms attended={r['attended_fraction']:.3f} "
                  f"overhead/saved={'n/a' if f is None else format(f, '.2f')}")
        print("  skipped:", shape["skipped"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
