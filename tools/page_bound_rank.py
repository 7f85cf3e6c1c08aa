"""How well Quest's page bound ranks a layer's pages, against the page's true best logit.

One essay context of ``--length`` tokens is run densely; for each layer the last query and every
key are captured as the model's attention receives them (after RoPE and any key norm). Per query
head, on pages of ``--page-size`` keys, the bound is Quest's ``sum_d max(q_d min_d, q_d max_d)``
and the truth is the page's largest ``q . k``. Printed per layer (means over query heads): the
rank correlation of the two, the overlap of their top ``1/--reduction-factor`` pages, the mean per-channel
range of a page relative to the channel's range over the whole context, and the coefficient of
variation of the key norms.

    python tools/page_bound_rank.py --model gemma3-270m --length 8192 --layers 5 11 17

Used for the Quest paragraph in docs/results/eval_gemma.md ("Gemma 3 270M at 8K").
"""
from __future__ import annotations

import argparse

import torch

from kvsieve.eval.attention_capture import last_query_capture
from kvsieve.eval.model import load_model
from kvsieve.eval.text_corpus import corpus_documents
from kvsieve.selectors.common.text_windows import token_windows


def page_bound_rank(q: torch.Tensor, k: torch.Tensor, page_size: int, reduction_factor: int) -> dict[str, float]:
    """``q [Hq, D]``, ``k [L, Hkv, D]`` fp32 -> the four numbers of the module docstring."""
    n = k.shape[0] // page_size
    hkv, d = k.shape[1], k.shape[2]
    group = q.shape[0] // hkv
    pages = k[: n * page_size].view(n, page_size, hkv, d)
    kmin, kmax = pages.amin(1), pages.amax(1)  # [n, Hkv, D]
    top = max(n // reduction_factor, 1)
    rho, overlap = [], []
    for h in range(q.shape[0]):
        kh, qh = h // group, q[h]
        bound = torch.maximum(qh * kmin[:, kh], qh * kmax[:, kh]).sum(-1)  # [n]
        true = (pages[:, :, kh] @ qh).amax(1)  # [n]
        ranks = torch.stack([bound.argsort().argsort(), true.argsort().argsort()]).float()
        rho.append(torch.corrcoef(ranks)[0, 1].item())
        overlap.append(len(set(bound.topk(top).indices.tolist()) & set(true.topk(top).indices.tolist())) / top)
    spread = ((kmax - kmin) / (k.amax(0) - k.amin(0)).clamp_min(1e-6)).mean().item()
    norms = k.norm(dim=-1)
    return {"rank_corr": sum(rho) / len(rho), "top_overlap": sum(overlap) / len(overlap),
            "page_range": spread, "key_norm_cv": (norms.std() / norms.mean()).item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--layers", type=int, nargs="+", required=True)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--reduction-factor", type=int, default=16, help="top pages compared: 1/N of them")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    essays = [d for d in corpus_documents() if d.source == "essays"]
    samples, _ = last_query_capture(lm.model, token_windows(lm.tokenizer, essays, args.length, 1), set(args.layers))
    for layer, (q, k, _) in zip(sorted(args.layers), samples):
        r = page_bound_rank(q[0], k, args.page_size, args.reduction_factor)
        print(f"{lm.name} L={k.shape[0]} layer {layer}: D={k.shape[2]} Hq/Hkv={q.shape[1]}/{k.shape[1]} | rank corr "
              f"{r['rank_corr']:.3f} | top 1/{args.reduction_factor} page overlap {r['top_overlap']:.3f} | page range / "
              f"context range {r['page_range']:.3f} | key norm cv {r['key_norm_cv']:.3f}")


if __name__ == "__main__":
    main()
