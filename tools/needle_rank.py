"""Does a distilled DSA indexer find the needle? On the eval's own ``niah_single`` (or
``--task passkey``) prompts, with the gold answer appended as the model would write it
(``: <value>,``; `` <key>.`` for passkey; teacher-forced), the model runs once
(``capture_attention``); for the last ``--rows`` positions (the answer rows, where the model reads
the needle) and each layer of the indexer file, it prints the dense attention mass on the needle
value's tokens, the mass kept at density ``1/--reduction-factor`` by the oracle (the exact top tokens of
the dense attention averaged over the query heads) and by the indexer's top tokens (index keys in
bf16, as the preset's ``index_k_dtype``), and the share of the needle's tokens each keeps.

    python tools/needle_rank.py --model gemma3-270m --length 8192 --projections gemma-8k.pt --samples 0 1

The prompts are the eval's (``--depths``, ``--per-depth``, ``--seed``: 0 as the benchmark's,
1 for the dev prompts an indexer is chosen on; as in ``tasks.<task>``);
``--samples`` picks among them. The needle's tokens are the value's first occurrence in the
haystack (passkey's needle states its key twice). Used for docs/results/dsa.md, section 6.3, and
docs/results/vllm_quality.md (why the 8K indexer lost the pass keys at 16K).
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from kvsieve.eval.attention_capture import capture_attention
from kvsieve.eval.model import ByteTokenizer, load_model
from kvsieve.eval.tasks import get_task
from kvsieve.selectors.dsa.distill import indexer_row_logits
from kvsieve.selectors.dsa.projections import load_projections


#: the gold answer as the model writes it after each task's prompt
_ANSWER = {"niah_single": ": {},", "passkey": " {}."}


def needle_tokens(tokenizer: Any, text: str, start: int, end: int) -> list[int]:
    """Token positions of ``text`` (special prefix included) covering characters ``start..end``."""
    if isinstance(tokenizer, ByteTokenizer):
        return list(range(len(text[:start].encode()), len(text[:end].encode())))
    enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
    return [i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > a and b > start and a < end]


def sample_rows(lm: Any, projs: dict[int, Any], text: str, span: list[int], rows: int, reduction_factor: int
                ) -> list[dict[str, Any]]:
    """One dict per (layer, answer row): needle mass, mass kept and needle share kept by oracle and dsa."""
    ids = torch.tensor([lm.tokenizer.encode(text, add_special_tokens=True)])
    length = ids.shape[1]
    pos = torch.arange(length - rows, length)
    caps = capture_attention(lm.model, ids, sorted(projs), pos)
    out = []
    for layer, cap in caps.items():
        p = cap.dense_attention(pos).mean(1)
        logits = indexer_row_logits(projs[layer], cap.hidden, pos, torch.bfloat16)
        for r, t in enumerate(pos.tolist()):
            k = -(-(t + 1) // reduction_factor)
            row = {"layer": layer, "needle_mass": float(p[r, span].sum())}
            for name, scores in (("oracle", p[r]), ("dsa", logits[r])):
                top = set(scores[: t + 1].topk(k).indices.tolist())
                row[f"recall_{name}"] = float(p[r, sorted(top)].sum())
                row[f"needle_{name}"] = sum(i in top for i in span) / len(span)
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--task", default="niah_single", choices=sorted(_ANSWER))
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--projections", required=True, help="a distilled indexer file (its layers are measured)")
    ap.add_argument("--depths", type=float, nargs="+", default=[10, 30, 50, 70, 90])
    ap.add_argument("--per-depth", type=int, default=2, help="prompts per depth, as the eval's samples")
    ap.add_argument("--samples", type=int, nargs="+", default=[0], help="which of those prompts")
    ap.add_argument("--seed", type=int, default=0, help="the eval's seed (vllm_quality.py's prompts: 0)")
    ap.add_argument("--rows", type=int, default=12, help="last positions measured (the answer rows)")
    ap.add_argument("--reduction-factor", type=int, default=16, help="tokens kept: 1/N of each row's context")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    projs = load_projections(args.projections)[0]
    samples = get_task(args.task).make_samples(lm.tokenizer, args.length, args.depths, args.per_depth, args.seed)
    rows = []
    for i in args.samples:
        s = samples[i]
        text = s.prompt + _ANSWER[args.task].format(s.answers[0])
        start = text.index(s.answers[0], s.meta["needle_char"])
        span = needle_tokens(lm.tokenizer, text, start, start + len(s.answers[0]))
        print(f"sample {i}: depth {s.depth}, needle tokens {span[0]}..{span[-1]} ({len(span)})", flush=True)
        rows += sample_rows(lm, projs, text, span, args.rows, args.reduction_factor)
    print(f"layer | needle mass | kept at 1/{args.reduction_factor}: oracle / dsa | needle tokens kept: oracle / dsa "
          f"(means over {len(args.samples)} prompts x {args.rows} rows)")
    for layer in sorted(projs):
        r = [x for x in rows if x["layer"] == layer]
        m = {key: statistics.mean(x[key] for x in r) for key in r[0] if key != "layer"}
        print(f"{layer} | {m['needle_mass']:.3f} | {m['recall_oracle']:.3f} / {m['recall_dsa']:.3f} | "
              f"{m['needle_oracle']:.2f} / {m['needle_dsa']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
