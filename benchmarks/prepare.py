"""Host-side metadata cost: ``AttentionMetadata.prepare()`` per translation against a per-request
Python-list baseline, plus the scaling of the capped block-offset copy.

The ledger is set up directly (block table rows filled with a random permutation of block ids, a
fragmented pool) on a KV cache manager whose pool is tiny: ``prepare()`` never reads the pool, so
``1024 x 128K`` tokens in 16-token pages cost 32 MiB of ledger, not a real cache.

The baseline is written in the style of engines that keep one Python list of block ids per request
and build every step's tables with ``list.extend`` per request, then one ``torch.tensor``; it
produces the same tables as the library (checked once per configuration: ``baseline_matches``).
It lives here, not in the library.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys

import numpy as np
import torch

from kvsieve.metadata import TRANSLATIONS, AttentionMetadata, KVCacheManager, KVCacheSpec

from ._timing import Timing, load_average, measure

__all__ = ["run", "main", "make_ledger", "ListBaseline"]

FULL = {"batches": [1, 64, 256, 1024], "contexts": [4096, 32768, 131072], "pages": [16, 64]}
QUICK = {"batches": [1, 8], "contexts": [256, 2048], "pages": [16]}
TARGET = {"batch": 256, "context": 32768, "page": 64, "min_speedup": 20.0}
BASELINE_MAX_BLOCKS = 2_200_000  # the Python-list baseline above this takes seconds and GiBs per step


def make_ledger(batch: int, context: int, page: int, capacity_tokens: int | None = None,
                seed: int = 0) -> KVCacheManager:
    """A manager whose ledger holds ``batch`` requests of ``context`` committed tokens (decode step:
    the last token is the step's new one). The pool itself has 2 blocks: only the ledger is used."""
    cap = capacity_tokens or context
    nblk = -(-context // page)
    spec = KVCacheSpec(num_layers=1, num_blocks=2, tokens_per_block=page, num_kv_heads=1, head_dim=1,
                       max_requests=batch, max_blocks_per_seq=-(-cap // page) + 1)
    mgr = KVCacheManager(spec)
    slots = [mgr.add_request(rid) for rid in range(batch)]  # no tokens yet: the ledger rows are written below
    rng = np.random.default_rng(seed)
    ids = (rng.permutation(batch * nblk) + 1).astype(np.int32).reshape(batch, nblk)
    mgr.block_table[slots, :nblk] = ids  # block ids past the 2-block pool: only the ledger is read
    mgr.num_blocks_of[slots] = nblk
    mgr.valid_lens[slots] = context
    mgr.addressable_lens[slots] = context
    return mgr


def make_metadata(mgr: KVCacheManager, translation: str) -> AttentionMetadata:
    b = mgr.spec.max_requests
    md = AttentionMetadata(kv_cache_manager=mgr, max_num_requests=b, max_num_tokens=b, translations=(translation,))
    md.request_ids = list(range(b))
    md.seq_lens = [1] * b
    md.num_contexts = 0
    return md


class ListBaseline:
    """Per-request Python lists, ``list.extend`` per request, then ``torch.tensor`` per table."""

    def __init__(self, mgr: KVCacheManager) -> None:
        self.page = mgr.tokens_per_block
        self.blocks = {rid: mgr.block_ids(rid) for rid in mgr.request_ids}
        self.kv_len = {rid: mgr.valid_len(rid) for rid in mgr.request_ids}

    def step(self, rids: list[int], seq_lens: list[int], num_contexts: int, translation: str) -> dict:
        page, i32 = self.page, torch.int32
        kv_lens, positions, token_req = [], [], []
        for i, (rid, s) in enumerate(zip(rids, seq_lens)):
            kv = self.kv_len[rid]
            kv_lens.append(kv)
            positions.extend(range(kv - s, kv))
            token_req.extend([i] * s)
        width = max(len(self.blocks[r]) for r in rids)
        table = []
        for r in rids:
            row = self.blocks[r]
            table.extend(row)
            table.extend([0] * (width - len(row)))
        out = {
            "kv_lens": torch.tensor(kv_lens, dtype=i32), "positions": torch.tensor(positions, dtype=i32),
            "token_to_req": torch.tensor(token_req, dtype=i32),
            "block_table": torch.tensor(table, dtype=i32).view(len(rids), width),
        }
        if translation == "block_lists":
            out["block_lists"] = [list(self.blocks[r]) for r in rids]
        elif translation == "ragged_page_table":
            indices, indptr = [], [0]
            for r in rids:
                n = -(-self.kv_len[r] // page)
                indices.extend(self.blocks[r][:n])
                indptr.append(len(indices))
            out.update(indices=torch.tensor(indices, dtype=i32), indptr=torch.tensor(indptr, dtype=i32))
        else:  # block_offsets, non-speculative: width capped at the longest row, beam width 1
            offs = []
            for r in rids:
                row = self.blocks[r]
                pad = width - len(row)
                offs.extend([2 * b for b in row])
                offs.extend([0] * pad)
                offs.extend([2 * b + 1 for b in row])
                offs.extend([1] * pad)
            out["offsets"] = torch.tensor(offs, dtype=i32).view(1, len(rids), 2, width)
        return out


def _matches(md: AttentionMetadata, ref: dict, translation: str) -> bool:
    b = md.num_seqs
    ok = torch.equal(md.kv_lens, ref["kv_lens"]) and torch.equal(md.positions, ref["positions"])
    ok &= torch.equal(md.token_to_req, ref["token_to_req"]) and torch.equal(md.block_table, ref["block_table"])
    if translation == "block_lists":
        ok &= md.block_ids_per_seq == ref["block_lists"]
    elif translation == "ragged_page_table":
        rpt = md.ragged_page_table
        ok &= torch.equal(rpt.paged_kv_indices, ref["indices"]) and torch.equal(rpt.paged_kv_indptr, ref["indptr"])
        ok &= torch.equal(rpt.batch_indices, ref["token_to_req"])
    else:
        t = md.block_offset_table
        ok &= torch.equal(t.kv_cache_block_offsets[:, :b, :, : t.width], ref["offsets"])
    return bool(ok)


def _row(kind: str, t: Timing | None) -> dict | None:
    return None if t is None else t.as_dict()


def bench_grid(batches: list[int], contexts: list[int], pages: list[int], budget_s: float) -> list[dict]:
    rows = []
    for page in pages:
        for ctx in contexts:
            for batch in batches:
                mgr = make_ledger(batch, ctx, page)
                blocks = batch * -(-ctx // page)
                base = ListBaseline(mgr) if blocks <= BASELINE_MAX_BLOCKS else None
                for tr in TRANSLATIONS:
                    md = make_metadata(mgr, tr)
                    lib = measure(md.prepare, budget_s=budget_s)
                    bt = matches = None
                    if base is not None:
                        rids, lens = list(range(batch)), [1] * batch
                        matches = _matches(md, base.step(rids, lens, 0, tr), tr)
                        bt = measure(lambda: base.step(rids, lens, 0, tr), budget_s=budget_s,
                                     max_reps=20 if blocks > 200_000 else 50)
                    rows.append({
                        "translation": tr, "batch": batch, "context": ctx, "page": page, "blocks": blocks,
                        "library": lib.as_dict(), "baseline": _row("baseline", bt),
                        "speedup": None if bt is None else bt.median_s / lib.median_s,
                        "baseline_matches": matches,
                        "us_per_request": lib.median_s * 1e6 / batch,
                        "ns_per_block": lib.median_s * 1e9 / blocks,
                    })
                    del md
                del mgr, base
                gc.collect()
    return rows


def bench_offsets_scaling(batches: list[int], context: int, page: int, capacities: list[int],
                          budget_s: float) -> list[dict]:
    """The block-offset translation alone at fixed context: capped copy (width = the batch's longest
    row) vs the speculative copy (the whole ``max_blocks_per_seq`` row), for table capacities from
    ``context`` to the largest; the capped cost should follow the batch, not the capacity."""
    rows = []
    for cap in capacities:
        for batch in batches:
            mgr = make_ledger(batch, context, page, capacity_tokens=cap)
            md = make_metadata(mgr, "block_offsets")
            capped = measure(md.prepare, budget_s=budget_s)
            mgr.addressable_lens[0] = context + 1  # one request holds a reserved draft slot -> speculative
            spec = measure(md.prepare, budget_s=budget_s)
            rows.append({"batch": batch, "context": context, "page": page, "capacity_tokens": cap,
                         "max_blocks_per_seq": mgr.spec.max_blocks_per_seq, "capped": capped.as_dict(),
                         "speculative": spec.as_dict(), "capped_us_per_request": capped.median_s * 1e6 / batch})
            del md, mgr
            gc.collect()
    return rows


def _target(rows: list[dict]) -> dict:
    out = {"batch": TARGET["batch"], "context": TARGET["context"], "page": TARGET["page"],
           "min_speedup": TARGET["min_speedup"], "per_translation": {}}
    for r in rows:
        if (r["batch"], r["context"], r["page"]) == (TARGET["batch"], TARGET["context"], TARGET["page"]):
            out["per_translation"][r["translation"]] = {
                "speedup": r["speedup"], "met": r["speedup"] is not None and r["speedup"] >= TARGET["min_speedup"]}
    out["measured"] = bool(out["per_translation"])
    return out


def _scaling_verdict(rows: list[dict]) -> dict:
    """Capped copy: ratio of the largest to the smallest capacity at each batch (~1 = flat), and the
    per-request cost across batches at the smallest capacity (~flat = linear in the batch)."""
    if not rows:
        return {}
    caps = sorted({r["capacity_tokens"] for r in rows})
    by = {(r["batch"], r["capacity_tokens"]): r for r in rows}
    batches = sorted({r["batch"] for r in rows})
    cap_ratio = {b: by[b, caps[-1]]["capped"]["median_s"] / by[b, caps[0]]["capped"]["median_s"] for b in batches}
    spec_ratio = {b: by[b, caps[-1]]["speculative"]["median_s"] / by[b, caps[0]]["speculative"]["median_s"]
                  for b in batches}
    per_req = {b: by[b, caps[0]]["capped_us_per_request"] for b in batches}
    return {"capacities": caps, "capped_time_ratio_largest_vs_smallest_capacity": cap_ratio,
            "speculative_time_ratio_largest_vs_smallest_capacity": spec_ratio,
            "capped_us_per_request_by_batch": per_req}


def run(quick: bool = False) -> dict:
    grid = QUICK if quick else FULL
    budget = 0.05 if quick else 0.25
    rows = bench_grid(grid["batches"], grid["contexts"], grid["pages"], budget)
    if quick:
        scaling = bench_offsets_scaling([1, 8], 256, 16, [256, 4096], budget)
    else:
        scaling = bench_offsets_scaling([64, 256, 1024], 4096, 64, [4096, 32768, 131072], budget)
    return {"grid": rows, "target": _target(rows), "offsets_scaling": scaling,
            "offsets_scaling_summary": _scaling_verdict(scaling), "load_1m_end": load_average(),
            "baseline_max_blocks": BASELINE_MAX_BLOCKS}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.prepare", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    res = run(args.quick)
    for r in res["grid"]:
        sp = "n/a" if r["speedup"] is None else f"{r['speedup']:.1f}x"
        print(f"prepare {r['translation']:18s} B={r['batch']:5d} ctx={r['context']:6d} page={r['page']:2d} "
              f"lib={r['library']['median_s'] * 1e3:8.3f} ms  baseline="
              f"{'n/a' if r['baseline'] is None else format(r['baseline']['median_s'] * 1e3, '8.3f')} ms  {sp}")
    print(json.dumps(res["target"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
