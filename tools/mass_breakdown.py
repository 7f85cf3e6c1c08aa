"""Where a selector loses attention mass, per layer: one essay prefix is prefilled densely, then a
few tokens are decoded teacher-forced with each selector; on every selected layer and step the
dense attention of the same query over the same cache is split into the sinks (first 4
positions), the recent window (last ``--recent`` positions) and the rest, and the share of each
that the selection kept is printed (mean over steps and query heads).

    python tools/mass_breakdown.py --model gemma3-270m --length 8192 --budget 512 --selectors quest streaming

Selector parameters: ``--params quest=page_size:16,summary_dtype:bfloat16``. Used for the
per-layer breakdown in docs/results/eval_gemma.md ("Gemma 3 270M at 8K").
"""
from __future__ import annotations

import argparse
import random

import torch

from kvsieve import SparseAttentionConfig
from kvsieve.eval.haystack import essay_haystack
from kvsieve.eval.model import load_model
from kvsieve.integrations.transformers import KvsieveSession, gather_request_kv
from kvsieve.sparse import get_selector_class, lower_budget, selection_mask


def _params(text: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in filter(None, text.split(",")):
        key, value = item.split(":")
        out[key] = int(value) if value.isdigit() else value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=512, help="tokens attended per query (each selector's own knob)")
    ap.add_argument("--selectors", nargs="+", default=["quest", "streaming"])
    ap.add_argument("--params", nargs="*", default=[], help="selector=key:value,key:value")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--recent", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    extra = {p.split("=", 1)[0]: _params(p.split("=", 1)[1]) for p in args.params}
    lm = load_model(args.model)
    text = essay_haystack(lm.tokenizer, args.length, start=random.Random(0).randrange(1000))
    ids = torch.tensor([lm.tokenizer.encode(text)])
    session = KvsieveSession(lm.model, None, backend="torch", max_tokens=ids.shape[1] + 64,
                             decode_threads=args.threads)
    session.prefill(ids[:, : -args.steps])
    base = session.num_cached_positions
    print(f"{lm.name}: {ids.shape[1]} tokens, budget {args.budget}, {args.steps} decode steps")
    for name in args.selectors:
        session.rewind(base)
        params = extra.get(name, {})
        budget = lower_budget(get_selector_class(name), params, ids.shape[1], tokens=args.budget)  # its own knob
        session.set_config(SparseAttentionConfig(name, params | budget.knob, phases=("generation",)))
        stats: dict[int, list[torch.Tensor]] = {}

        def observe(layer_idx, q, result, md, layer) -> None:
            if result.params is None:
                return
            k, _ = gather_request_kv(md.kv_cache_manager, layer_idx, md.request_ids[0])
            g = layer.geometry
            grp = q.shape[1] // g.num_kv_heads
            p = torch.softmax(torch.einsum("thd,lhd->thl", q.float(), k.float().repeat_interleave(grp, 1))
                              * g.sm_scale, -1)  # [T, Hq, L] dense attention
            kept = selection_mask(result.params, slice(0, q.shape[0]), md.token_kv_lens, k.shape[0],
                                  g.num_kv_heads).permute(1, 0, 2).repeat_interleave(grp, 1).float()
            parts = (slice(0, 4), slice(4, k.shape[0] - args.recent), slice(k.shape[0] - args.recent, None))
            row = [(p * kept).sum(-1).mean()]
            for part in parts:
                row += [p[..., part].sum(-1).mean(), (p * kept)[..., part].sum(-1).mean()]
            stats.setdefault(layer_idx, []).append(torch.stack(row))

        session.observers.append(observe)
        try:
            for i in range(ids.shape[1] - args.steps, ids.shape[1]):
                session.decode(ids[:, i])
        finally:
            session.observers.remove(observe)
        for layer_idx, rows in sorted(stats.items()):
            r = torch.stack(rows).mean(0).tolist()
            print(f"{name:12} layer {layer_idx:2}: recall {r[0]:.3f} | sinks {r[2]:.3f} of {r[1]:.3f} | "
                  f"middle {r[4]:.3f} of {r[3]:.3f} | last {args.recent} {r[6]:.3f} of {r[5]:.3f}")


if __name__ == "__main__":
    main()
