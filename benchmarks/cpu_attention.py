"""CPU attention: the ``torch`` backend's sparse decode and block-sparse prefill against dense
``scaled_dot_product_attention`` on the same data, and prefill against FlexAttention with an
equivalent ``BlockMask``.

* Decode (batch 1, one query token): block-sparse selection at the cache page (``density`` of the
  pages, per KV head, newest page forced), paged cache in HND fp32. The dense baseline is SDPA on
  contiguous ``[1, Hkv, L, D]`` copies of the same K/V with the query heads grouped per KV head
  (``q [1, Hkv, G, D]``; the fastest exact dense decode form on CPU, measured faster than
  ``enable_gqa=True`` which expands K/V). Reported: speedup vs SDPA against the ideal
  ``1/density``, and the bytes the backend gathers per second against a memory-copy bandwidth
  measured in the same run (bytes copied per second, same counting).
* Prefill (one request of ``L`` tokens, causal): per query block of 128 tokens and KV head, the
  diagonal block plus random earlier blocks (``density`` of the blocks); FlexAttention gets the
  same blocks as a ``BlockMask`` (``mask_mod`` = causal), compiled with ``torch.compile`` when
  that works here (else eager, labelled); dense SDPA runs ``is_causal=True`` on expanded K/V heads.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
import warnings

import torch
import torch.nn.functional as F

from kvsieve import AttentionMetadata, KVCacheManager, KVCacheSpec, SparseRuntimeParams
from kvsieve.metadata import TRANSLATIONS
from kvsieve.sparse.backends import AttentionGeometry, get_backend

from ._timing import load_average, measure

__all__ = ["run", "main", "copy_bandwidth"]

FULL = {
    "decode": {"hq": 32, "hkv": 8, "d": 128, "page": 64, "contexts": [8192, 32768, 65536, 131072],
               "reduction_factors": [8, 16, 32, 64]},
    "prefill": {"hq": 8, "hkv": 2, "d": 64, "page": 64, "block": 128, "lengths": [4096, 16384],
                "reduction_factors": [4, 16]},
}
QUICK = {
    "decode": {"hq": 4, "hkv": 2, "d": 32, "page": 16, "contexts": [512, 1024], "reduction_factors": [4, 8]},
    "prefill": {"hq": 4, "hkv": 2, "d": 32, "page": 16, "block": 32, "lengths": [256], "reduction_factors": [4]},
}
TARGET = {"context": 65536, "reduction_factor": 32, "min_speedup": 10.0}
# the eager FlexAttention cross-check materializes all [Hq, L, L] fp32 scores (8.6 GB at 16K)
EAGER_FLEX_MAX_SCORE_BYTES = 2 << 30


def copy_bandwidth(nbytes: int = 256 << 20, budget_s: float = 0.5) -> dict:
    """GB/s of ``dst.copy_(src)`` on fp32 buffers of ``nbytes`` (bytes copied / time)."""
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), budget_s=budget_s)
    return {"bytes": nbytes, "timing": t.as_dict(), "gb_per_s": nbytes / t.median_s / 1e9,
            "gb_per_s_best": nbytes / t.min_s / 1e9}


def _cache(length: int, hkv: int, d: int, page: int, seq: int, seed: int = 0):
    """One request of ``length`` tokens, the last ``seq`` of them new this step; pool pages
    shuffled (a fragmented cache)."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-length // page)
    spec = KVCacheSpec(num_layers=1, num_blocks=nb + 1, tokens_per_block=page, num_kv_heads=hkv, head_dim=d,
                       max_requests=1, max_blocks_per_seq=nb)
    mgr = KVCacheManager(spec)
    mgr.add_request(0, length - seq)
    mgr.append_tokens(0, seq)
    mgr.block_table[0, :nb] = (torch.randperm(nb, generator=g) + 1).numpy()
    pool = mgr.pools[0]
    for i in range(0, pool.shape[0], 512):  # chunked so the generator never holds a second copy
        pool[i: i + 512].normal_(generator=g)
    md = AttentionMetadata(kv_cache_manager=mgr, max_num_requests=1, max_num_tokens=seq, translations=TRANSLATIONS)
    md.request_ids = [0]
    md.seq_lens = [seq]
    md.num_contexts = 0 if seq == 1 else 1
    md.prepare()
    table = torch.from_numpy(mgr.block_table[0, :nb].astype("int64"))
    k = mgr.k_cache(0)[table].permute(1, 0, 2, 3).reshape(1, hkv, nb * page, d)[:, :, :length].contiguous()
    v = mgr.v_cache(0)[table].permute(1, 0, 2, 3).reshape(1, hkv, nb * page, d)[:, :, :length].contiguous()
    return mgr, md, k, v


def bench_decode(cfg: dict, budget_s: float, bandwidth: dict) -> list[dict]:
    hq, hkv, d, page = cfg["hq"], cfg["hkv"], cfg["d"], cfg["page"]
    g = hq // hkv
    geo = AttentionGeometry(kind="gqa", num_q_heads=hq, num_kv_heads=hkv, head_dim=d, sm_scale=d ** -0.5)
    backend = get_backend("torch")
    rows = []
    for length in cfg["contexts"]:
        mgr, md, k, v = _cache(length, hkv, d, page, 1)
        q = torch.randn(1, hq, d, generator=torch.Generator().manual_seed(1))
        qg = q.view(1, hkv, g, d)
        sdpa = measure(lambda: F.scaled_dot_product_attention(qg, k, v, scale=geo.sm_scale), budget_s=budget_s)
        dense = measure(lambda: backend.forward(q, md, 0, geo, None), budget_s=budget_s)
        ref = F.scaled_dot_product_attention(qg, k, v, scale=geo.sm_scale).reshape(1, hq, d)
        dense_err = float((backend.forward(q, md, 0, geo, None).out - ref).abs().max())
        nb = -(-length // page)
        for dens in cfg["reduction_factors"]:
            n_sel = max(1, nb // dens)
            gen = torch.Generator().manual_seed(dens)
            sel = torch.stack([torch.cat([torch.tensor([nb - 1]), torch.randperm(nb - 1, generator=gen)[: n_sel - 1]])
                               for _ in range(hkv)]).view(1, hkv, n_sel).to(torch.int32)
            params = SparseRuntimeParams.from_topk(sel, block_size=page)
            t = measure(lambda: backend.forward(q, md, 0, geo, params), budget_s=budget_s)
            # exactness: the same selection as a dense mask on the contiguous copy
            pos = (sel.view(hkv, n_sel, 1).long() * page + torch.arange(page)).view(hkv, -1)
            mask = torch.zeros(hkv, length, dtype=torch.bool).scatter_(1, pos.clamp(max=length - 1), True)
            ref_sparse = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask.view(1, hkv, 1, length),
                                                        scale=geo.sm_scale).reshape(1, hq, d)
            res = backend.forward(q, md, 0, geo, params)
            err = float((res.out - ref_sparse).abs().max())
            gathered = hkv * n_sel * page * d * 4 * 2  # K and V bytes read through the block table
            rows.append({
                "context": length, "density": f"1/{dens}", "reduction_factor": dens, "selected_tokens_per_head": n_sel * page,
                "sparse": t.as_dict(), "sdpa_dense": sdpa.as_dict(), "torch_dense": dense.as_dict(),
                "speedup_vs_sdpa": sdpa.median_s / t.median_s, "ideal_speedup": float(dens),
                "fraction_of_ideal": sdpa.median_s / t.median_s / dens,
                "gathered_bytes": gathered, "gathered_gb_per_s": gathered / t.median_s / 1e9,
                "fraction_of_copy_bandwidth": gathered / t.median_s / 1e9 / bandwidth["gb_per_s"],
                "sdpa_dense_gb_per_s": 2 * k.numel() * 4 / sdpa.median_s / 1e9,
                "max_abs_err_vs_masked_sdpa": err, "dense_max_abs_err_vs_sdpa": dense_err,
                "path": res.paths["generation"],
            })
        del mgr, md, k, v
        gc.collect()
    return rows


def _prefill_selection(length: int, block: int, hkv: int, dens: int, seed: int) -> torch.Tensor:
    """int64 ``[Hkv, nq, k]`` kv blocks per query block (diagonal + random earlier, -1 padded)."""
    nq = length // block
    k = max(1, nq // dens)
    gen = torch.Generator().manual_seed(seed)
    sel = torch.full((hkv, nq, k), -1, dtype=torch.int64)
    for h in range(hkv):
        for i in range(nq):
            earlier = torch.randperm(i, generator=gen)[: k - 1] if i else torch.empty(0, dtype=torch.int64)
            blocks = torch.cat([torch.tensor([i]), earlier])
            sel[h, i, : blocks.numel()] = blocks
    return sel


def _flex(compile_flex: bool):
    from torch.nn.attention.flex_attention import flex_attention
    if not compile_flex:
        return flex_attention, "eager", None
    return torch.compile(flex_attention, dynamic=False), "compiled", None


def bench_prefill(cfg: dict, budget_s: float, compile_flex: bool) -> tuple[list[dict], dict]:
    from torch.nn.attention.flex_attention import BlockMask
    hq, hkv, d, page, block = cfg["hq"], cfg["hkv"], cfg["d"], cfg["page"], cfg["block"]
    g = hq // hkv
    geo = AttentionGeometry(kind="gqa", num_q_heads=hq, num_kv_heads=hkv, head_dim=d, sm_scale=d ** -0.5)
    backend = get_backend("torch")
    t0 = time.perf_counter()
    flex, flex_mode, flex_error = _flex(compile_flex)
    flex_info = {"mode": flex_mode, "compile_error": flex_error, "setup_s": time.perf_counter() - t0}
    rows = []
    compiled_ok: set[int] = set()
    from torch.nn.attention.flex_attention import flex_attention as eager_flex

    for length in cfg["lengths"]:
        mgr, md, k, v = _cache(length, hkv, d, page, length)
        q = torch.randn(length, hq, d, generator=torch.Generator().manual_seed(2))
        q4 = q.permute(1, 0, 2).unsqueeze(0).contiguous()  # [1, Hq, L, D]
        ke, ve = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        sdpa = measure(lambda: F.scaled_dot_product_attention(q4, ke, ve, is_causal=True, scale=geo.sm_scale),
                       budget_s=budget_s, min_reps=2)
        for dens in cfg["reduction_factors"]:
            sel = _prefill_selection(length, block, hkv, dens, seed=dens)  # [Hkv, nq, k]
            nq, kk = sel.shape[1], sel.shape[2]
            per_tok = sel.repeat_interleave(block, dim=1).permute(1, 0, 2)  # [L, Hkv, k]
            params = SparseRuntimeParams.from_topk(per_tok.to(torch.int32), block_size=block)
            t_sparse = measure(lambda: backend.forward(q, md, 0, geo, params), budget_s=budget_s, min_reps=2,
                               max_reps=5)
            num = (sel >= 0).sum(-1).to(torch.int32).repeat_interleave(g, dim=0).unsqueeze(0)  # [1, Hq, nq]
            big = nq + 1  # valid blocks first (flex reads the first kv_num_blocks entries), padding after
            idx = torch.where(sel >= 0, sel, big).sort(dim=-1).values
            idx = torch.where(idx == big, 0, idx).to(torch.int32)
            idx = torch.nn.functional.pad(idx, (0, nq - kk)).repeat_interleave(g, dim=0).unsqueeze(0)
            # the mask_mod must carry the selection too: eager flex applies only the mask_mod, the
            # block indices are the (compiled) kernel's sparsity
            allowed = torch.zeros(hkv, nq, nq + 1, dtype=torch.bool)
            allowed.scatter_(2, torch.where(sel >= 0, sel, nq), True)
            allowed = allowed[:, :, :nq].repeat_interleave(g, dim=0).contiguous()  # [Hq, nq, nq]

            def selected(b, h, q_idx, kv_idx, allowed=allowed):
                return (q_idx >= kv_idx) & allowed[h, q_idx // block, kv_idx // block]

            bm = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=block, mask_mod=selected, seq_lengths=(length, length))
            if flex_mode == "compiled" and length not in compiled_ok:
                t_c = time.perf_counter()
                try:  # first call compiles; any failure falls back to eager, reported
                    flex(q4, k, v, block_mask=bm, scale=geo.sm_scale, enable_gqa=True)
                    compiled_ok.add(length)
                    flex_info.setdefault("compile_s", {})[length] = time.perf_counter() - t_c
                except Exception as e:  # noqa: BLE001
                    flex_info["compile_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    flex, flex_mode = eager_flex, "eager"
                    flex_info["mode"] = "eager (compile failed)"
            try:
                t_flex = measure(lambda: flex(q4, k, v, block_mask=bm, scale=geo.sm_scale, enable_gqa=True),
                                 budget_s=budget_s, min_reps=2, max_reps=5)
                ref = flex(q4, k, v, block_mask=bm, scale=geo.sm_scale, enable_gqa=True)[0].permute(1, 0, 2)
                ours = backend.forward(q, md, 0, geo, params).out
                err = float((ours - ref).abs().max())
                if flex_mode != "compiled":
                    err_eager = err
                elif hq * length * length * 4 <= EAGER_FLEX_MAX_SCORE_BYTES:
                    eager_ref = eager_flex(q4, k, v, block_mask=bm, scale=geo.sm_scale, enable_gqa=True)
                    err_eager = float((ours - eager_ref[0].permute(1, 0, 2)).abs().max())
                else:  # eager flex materializes every [Hq, L, L] score: not run at this length
                    err_eager = None
                flex_row, flex_fail = t_flex.as_dict(), None
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                flex_row, flex_fail, err, err_eager, t_flex = None, f"{type(e).__name__}: {e}"[:300], None, None, None
            visited = int((sel >= 0).sum())  # kv blocks per (KV head, q block)
            rows.append({
                "length": length, "density": f"1/{dens}", "reduction_factor": dens, "block": block,
                "kv_blocks_visited_fraction": visited / (hkv * nq * (nq + 1) / 2),
                "sparse": t_sparse.as_dict(), "flex": flex_row, "flex_mode": flex_mode, "flex_error": flex_fail,
                "sdpa_dense_causal": sdpa.as_dict(),
                "speedup_vs_sdpa": sdpa.median_s / t_sparse.median_s,
                "speedup_vs_flex": None if t_flex is None else t_flex.median_s / t_sparse.median_s,
                "flex_speedup_vs_sdpa": None if t_flex is None else sdpa.median_s / t_flex.median_s,
                "ideal_speedup_vs_causal": 1.0 / (visited / (hkv * nq * (nq + 1) / 2)),
                "max_abs_err_vs_flex": err, "max_abs_err_vs_flex_eager": err_eager,
            })
        del mgr, md, k, v, ke, ve
        gc.collect()
    return rows, flex_info


def _target(rows: list[dict]) -> dict:
    hit = [r for r in rows if r["context"] == TARGET["context"] and r["reduction_factor"] == TARGET["reduction_factor"]]
    if not hit:
        return {**TARGET, "measured": False}
    sp = hit[0]["speedup_vs_sdpa"]
    return {**TARGET, "measured": True, "speedup": sp, "met": sp >= TARGET["min_speedup"]}


def run(quick: bool = False, compile_flex: bool = True) -> dict:
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    cfg = QUICK if quick else FULL
    budget = 0.05 if quick else 0.4
    bw = copy_bandwidth(8 << 20 if quick else 256 << 20, budget)
    decode = bench_decode(cfg["decode"], budget, bw)
    try:
        prefill, flex_info = bench_prefill(cfg["prefill"], budget, compile_flex)
    except Exception:  # noqa: BLE001 - the decode part stands on its own
        prefill, flex_info = [], {"mode": "failed", "compile_error": traceback.format_exc()[-600:]}
    return {"config": cfg, "copy_bandwidth": bw, "decode": decode, "prefill": prefill, "flex": flex_info,
            "target": _target(decode), "load_1m_end": load_average()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cpu_attention", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-compile", action="store_true", help="time FlexAttention eager only")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    res = run(args.quick, not args.no_compile)
    print(f"copy bandwidth {res['copy_bandwidth']['gb_per_s']:.1f} GB/s")
    for r in res["decode"]:
        print(f"decode ctx={r['context']:6d} {r['density']:>5s} sparse={r['sparse']['median_s'] * 1e3:8.2f} ms "
              f"sdpa={r['sdpa_dense']['median_s'] * 1e3:8.2f} ms speedup={r['speedup_vs_sdpa']:.1f}x "
              f"(ideal {r['ideal_speedup']:.0f}x) {r['gathered_gb_per_s']:.1f} GB/s err={r['max_abs_err_vs_masked_sdpa']:.1e}")
    for r in res["prefill"]:
        fl = "n/a" if r["flex"] is None else f"{r['flex']['median_s'] * 1e3:.1f}"
        print(f"prefill L={r['length']} {r['density']} sparse={r['sparse']['median_s'] * 1e3:.1f} ms "
              f"flex({r['flex_mode']})={fl} ms sdpa={r['sdpa_dense_causal']['median_s'] * 1e3:.1f} ms")
    print(json.dumps(res["target"]), json.dumps({k: v for k, v in res["flex"].items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
