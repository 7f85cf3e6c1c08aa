"""``kvsieve distill-indexer``: give a model without a trained DSA indexer one, by DSA's dense
warm-up (DeepSeek-V3.2 tech report). The model is frozen; per layer an
:class:`~kvsieve.selectors.dsa.projections.IndexerProjections` (from the layer's attention-input
hidden state) is trained to minimise ``KL(p || softmax(I))``, where ``p`` is the layer's dense
attention averaged over its query heads and ``I`` the indexer logits.

Training runs at the evaluation length: each window of ``seq_len`` tokens is run once through
the frozen model, and for ``rows`` query positions sampled per window (each scored against every
key it sees) the targets ``p`` are kept with the layer's hidden states, so memory grows with
``rows x seq_len``, not ``seq_len**2``. The windows come from :mod:`.distill_corpus` (essays,
Python reference text, licences) with a recorded train / held-out split. After every epoch the
KL on the training and held-out windows and the held-out recall at densities 1/4, 1/16, 1/64
(the dense mass the indexer's top-k keeps) are recorded with the elapsed wall and CPU time.

The projections go to one small file that the ``dsa`` selector loads (``DSAConfig(projections=
...)``); :func:`attach_dsa_indexer` feeds it the hidden states inside a
:class:`~kvsieve.integrations.transformers.KvsieveSession`.

    kvsieve distill-indexer --model smollm2 --out smollm2-indexer.pt --json curve.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..cli import plain
from ..integrations.transformers import MODEL_INPUTS_KWARG
from ..selectors.dsa.projections import IndexerInputs, IndexerProjections, save_projections
from .distill_config import DistillConfig
from .distill_corpus import corpus_documents, special_prefix, split_documents, token_windows

__all__ = ["DistillConfig", "WindowTargets", "Checkpoint", "DistillResult", "Corpus", "DENSITIES", "collect", "fit", "distill",
           "LayerCapture", "windowed_attention", "capture_attention", "capture_targets", "cached_capture", "indexer_row_logits", "row_kl", "row_recall", "trainable_layers",
           "attach_dsa_indexer", "special_prefix", "main"]

#: the densities of the held-out recall (budget = ceil(context / density) per query row)
DENSITIES = (4, 16, 64)
_CAPTURE = "kvsieve_distill_capture"


@dataclass(frozen=True)
class WindowTargets:
    """One window's training data: the sampled query ``rows [R]`` (ascending), per layer the
    attention-input ``hidden [S, hidden_size]`` (bf16) and ``p [R, S]`` (fp16; the causal dense
    attention of each sampled row, averaged over the query heads; 0 past the row)."""

    rows: torch.Tensor
    hidden: dict[int, torch.Tensor]
    p: dict[int, torch.Tensor]


@dataclass(frozen=True)
class Checkpoint:
    """After ``epoch`` epochs (0 = untrained), ``seconds`` wall and ``cpu_seconds`` process CPU
    since :func:`distill` began (captures included): mean KL on the training and held-out
    windows and the held-out recall per density (:data:`DENSITIES`)."""

    epoch: int
    seconds: float
    cpu_seconds: float
    train_kl: float
    heldout_kl: float
    recall: dict[int, float]


@dataclass(frozen=True)
class DistillResult:
    """The trained ``projections`` per layer, the training ``curve``, the held-out recall per
    density of ``streaming`` (4 sinks + recent window, for comparison) and of the ``oracle`` (the
    exact top positions of ``p``: the ceiling of any one set of positions shared by the query heads,
    as the indexer's is), and the document ``split``."""

    projections: dict[int, IndexerProjections]
    curve: list[Checkpoint]
    streaming: dict[int, float]
    oracle: dict[int, float]
    split: dict[str, list[str]]


def _rope_theta(cfg: Any) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    if "full_attention" in params:  # per layer type (Gemma 3)
        params = params["full_attention"]
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def trainable_layers(model_config: Any, layers: list[int] | None) -> list[int]:
    """``layers`` (default: the full-attention layers) after refusing any sliding-window layer:
    the targets are full causal attention."""
    from ..sparse.sparse_layers import sparse_layers

    cfg = getattr(model_config, "text_config", model_config)
    types = getattr(cfg, "layer_types", None)
    chosen = sorted(sparse_layers(num_layers=cfg.num_hidden_layers, model_layer_types=types, layers=layers,
                                  layer_types=None, dense_layers=[]))
    sliding = [i for i in chosen if types is not None and types[i] != "full_attention"]
    if sliding:
        raise ValueError(f"distill: layers {sliding} are {sorted({types[i] for i in sliding})} layers; the indexer "
                         "is distilled from full causal attention only")
    return chosen


def _sample_rows(seq_len: int, rows: int, gen: torch.Generator) -> torch.Tensor:
    """``rows`` distinct positions from the last 7/8 of the window, the last position always among them."""
    lo = min(seq_len // 8, seq_len - rows)
    pick = torch.randperm(seq_len - 1 - lo, generator=gen)[: rows - 1] + lo
    return torch.cat([pick, torch.tensor([seq_len - 1])]).sort().values


@dataclass(frozen=True)
class LayerCapture:
    """One layer of one window as its attention receives it: the attention-input ``hidden [S,
    hidden_size]`` (bf16), the queries of the chosen ``rows`` ``q [R, Hq, D]`` and every key
    ``k [S, Hkv, D]`` (fp32, RoPE and any norm applied) and the softmax ``scale``."""

    hidden: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    scale: float

    def dense_attention(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 ``[R, Hq, S]``: the causal softmax of each row's query heads over the keys."""
        k = self.k.repeat_interleave(self.q.shape[1] // self.k.shape[1], 1)
        s = torch.einsum("rhd,shd->rhs", self.q, k) * self.scale
        return torch.softmax(s.masked_fill((torch.arange(k.shape[0]) > rows[:, None])[:, None], float("-inf")), -1)


def windowed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int,
                       scaling: float | None) -> torch.Tensor:
    """Causal sliding-window attention of one sequence, in query chunks of ``window`` rows that each
    read only the ``2 * window - 1`` keys they can see: ``query [1, Hq, S, D]``, ``key``/``value
    [1, Hkv, S, D]`` -> ``[1, S, Hq, D]`` (the layout transformers' attention functions return).
    Position ``t`` attends ``s`` with ``t - window < s <= t`` (transformers' sliding mask); the cost
    is ``O(S * window)`` instead of the masked full ``O(S**2)``."""
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    s = query.shape[2]
    out = torch.empty_like(query)
    for c0 in range(0, s, window):
        c1, k0 = min(s, c0 + window), max(0, c0 - window + 1)
        qpos, kpos = torch.arange(c0, c1)[:, None], torch.arange(k0, c1)[None]
        mask = (kpos <= qpos) & (kpos > qpos - window)
        out[:, :, c0:c1] = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, c0:c1], key[:, :, k0:c1], value[:, :, k0:c1], attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous()


def capture_attention(model: torch.nn.Module, ids: torch.Tensor, layers: list[int], rows: torch.Tensor
                      ) -> dict[int, LayerCapture]:
    """Run the frozen model once over ``ids [1, S]``; per layer of ``layers`` its
    :class:`LayerCapture` at query ``rows``. Refuses a layer whose attention is not plain causal
    softmax (logit soft-capping, a sliding window). The other sliding-window layers run
    :func:`windowed_attention`."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    hidden: dict[int, torch.Tensor] = {}
    found: dict[int, LayerCapture] = {}
    wanted = set(layers)

    def capture(module, query, key, value, attention_mask, **kwargs):
        i = getattr(module, "layer_idx", None)
        if i not in wanted and kwargs.get("sliding_window") and kwargs.get("softcap") is None:
            return windowed_attention(query, key, value, kwargs["sliding_window"], kwargs.get("scaling")), None
        if i in wanted:
            for name in ("softcap", "sliding_window"):
                if kwargs.get(name) is not None:
                    raise ValueError(f"distill: layer {i} attention has {name}={kwargs[name]}; only plain causal "
                                     "softmax attention is distilled")
            scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
            found[i] = LayerCapture(hidden[i], query[0][:, rows].transpose(0, 1).float(),
                                    key[0].transpose(0, 1).float(), float(scale))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def pre(mod, args, kwargs):
        hidden[mod.layer_idx] = kwargs["hidden_states"][0].detach().bfloat16()

    attns = [layer.self_attn for layer in model.get_decoder().layers]
    hooks = [attns[i].register_forward_pre_hook(pre, with_kwargs=True) for i in layers]
    AttentionInterface.register(_CAPTURE, capture)
    AttentionMaskInterface.register(_CAPTURE, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(_CAPTURE)
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        model.set_attn_implementation(previous)
        for h in hooks:
            h.remove()
    return {i: found[i] for i in layers}


def capture_targets(model: torch.nn.Module, ids: torch.Tensor, layers: list[int], rows: torch.Tensor) -> WindowTargets:
    """Run the frozen model once over ``ids [1, S]`` and keep, for ``layers``, the targets of
    ``rows`` (:class:`WindowTargets`)."""
    caps = capture_attention(model, ids, layers, rows)
    return WindowTargets(rows, {i: c.hidden for i, c in caps.items()},
                         {i: c.dense_attention(rows).mean(1).half() for i, c in caps.items()})


def cached_capture(path: Path | None, key: dict[str, Any], capture: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``key | capture()``, kept in the file ``path`` and read back from there instead when the
    file holds the same ``key`` (strings compared as strings, anything else as tensors). The
    captures are the expensive part of a run: a run stopped midway keeps the windows it finished."""
    def same(a: Any, b: Any) -> bool:
        return a == b if isinstance(b, str) else torch.equal(torch.as_tensor(a), torch.as_tensor(b))

    if path is not None and path.is_file():
        saved = torch.load(path, weights_only=True)
        if all(k in saved and same(saved[k], v) for k, v in key.items()):
            return saved
    out = key | capture()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(out, tmp)
        tmp.replace(path)
    return out


def indexer_row_logits(proj: IndexerProjections, hidden: torch.Tensor, rows: torch.Tensor,
                       key_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp32 ``[R, S]`` logits ``sum_h w relu(q k)`` of query ``rows`` over every key of the
    window (``-inf`` past each row); the index keys rounded to ``key_dtype`` as the selector's
    pool stores them (``index_k_dtype``)."""
    s = hidden.shape[0]
    k = proj.keys(hidden, torch.arange(s)).to(key_dtype).float()
    q, w = proj.queries(hidden[rows], rows)
    logits = torch.einsum("rh,rhs->rs", w, torch.einsum("rhd,sd->rhs", q, k).relu())
    return logits.masked_fill(torch.arange(s) > rows[:, None], float("-inf"))


def row_kl(p: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of ``KL(p || softmax(logits))`` (``p`` rows sum to 1 and are 0 where the
    logits are ``-inf``)."""
    logq = torch.log_softmax(logits, -1)
    p = p.float()
    return torch.where(p > 0, p * (torch.log(p.clamp(min=1e-30)) - logq), torch.zeros_like(p)).sum(-1).mean()


def row_recall(p: torch.Tensor, scores: torch.Tensor, rows: torch.Tensor, density: int) -> float:
    """Mean over rows of the mass ``p [R, S]`` kept by the top ``ceil((row + 1) / density)``
    positions of ``scores [R, S]`` (``-inf`` past each row)."""
    kept = []
    for r, t in enumerate(rows.tolist()):
        k = -(-(t + 1) // density)
        kept.append(float(p[r].float()[scores[r, : t + 1].topk(k).indices].sum()))
    return sum(kept) / len(kept)


def _streaming_recall(p: torch.Tensor, rows: torch.Tensor, density: int, num_sink: int = 4) -> float:
    kept = []
    for r, t in enumerate(rows.tolist()):
        k = -(-(t + 1) // density)
        recent = p[r, max(num_sink, t + 1 - (k - num_sink)): t + 1].float().sum()
        kept.append(float(p[r, :num_sink].float().sum() + recent))
    return sum(kept) / len(kept)


def _evaluate(projs: dict[int, IndexerProjections], windows: list[WindowTargets], recall: bool
              ) -> tuple[float, dict[int, float]]:
    kls, kept = [], {d: [] for d in DENSITIES}
    with torch.no_grad():
        for w in windows:
            for i, proj in projs.items():
                logits = indexer_row_logits(proj, w.hidden[i], w.rows)
                kls.append(float(row_kl(w.p[i], logits)))
                for d in DENSITIES if recall else ():
                    kept[d].append(row_recall(w.p[i], logits, w.rows, d))
    return sum(kls) / len(kls), {d: sum(v) / len(v) for d, v in kept.items() if v}


@dataclass(frozen=True)
class Corpus:
    """The captured ``train`` and ``held`` (held-out) windows of one model and config, the layers,
    the model's ``hidden_size`` and RoPE ``theta``, the document ``split``, and when the capture
    began (``start``: wall and CPU clock) so that curves count the capture's cost."""

    train: list[WindowTargets]
    held: list[WindowTargets]
    layers: list[int]
    hidden_size: int
    theta: float
    split: dict[str, list[str]]
    start: tuple[float, float]


def collect(model: torch.nn.Module, tokenizer: Any, cfg: DistillConfig, layers: list[int] | None = None, *,
            progress: bool = True, captures: Path | None = None) -> Corpus:
    """Capture the training and held-out windows of ``cfg`` (the expensive, geometry-free part);
    with ``captures`` (a folder) each window's targets are kept there (:func:`cached_capture`,
    keyed by the model's weights, the tokens, the layers and the rows) and reused by a rerun."""
    start = time.perf_counter(), time.process_time()
    layers = trainable_layers(model.config, layers)
    for prm in model.parameters():
        prm.requires_grad_(False)
    train_docs, held_docs = split_documents(corpus_documents(), cfg.holdout_every)
    gen = torch.Generator().manual_seed(cfg.seed)
    from .model import model_hash

    key = {"model": model_hash(model), "layers": layers} if captures is not None else {}

    def window(ids: torch.Tensor, rows: torch.Tensor, path: Path | None) -> WindowTargets:
        def capture() -> dict[str, Any]:
            t = capture_targets(model, ids, layers, rows)
            return {"hidden": t.hidden, "p": t.p}

        saved = cached_capture(path, key | {"ids": ids, "rows": rows}, capture)
        return WindowTargets(rows, {int(i): h for i, h in saved["hidden"].items()},
                             {int(i): p for i, p in saved["p"].items()})

    def targets(docs, count, desc, name):
        windows = tqdm(token_windows(tokenizer, docs, cfg.seq_len, count), desc=desc, disable=not progress)
        return [window(ids, _sample_rows(cfg.seq_len, cfg.rows, gen), captures and Path(captures) / f"{name}-{j}.pt")
                for j, ids in enumerate(windows)]

    train = targets(train_docs, cfg.num_seqs, "train targets", "train")
    held = targets(held_docs, cfg.heldout_seqs, "held out", "held")
    text = getattr(model.config, "text_config", model.config)
    split = {"train": [f"{d.source}/{d.name}" for d in train_docs], "held_out": [f"{d.source}/{d.name}" for d in held_docs]}
    return Corpus(train, held, layers, text.hidden_size, _rope_theta(text), split, start)


def fit(corpus: Corpus, cfg: DistillConfig, *, progress: bool = True) -> DistillResult:
    """Train one indexer per layer of ``corpus`` at ``cfg``'s geometry, checkpointing every epoch."""
    t0, c0 = corpus.start
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    projs = {i: IndexerProjections(corpus.hidden_size, cfg.n_heads, cfg.head_dim, cfg.rope_dim, rope_theta=corpus.theta)
             for i in corpus.layers}
    opt = torch.optim.Adam([prm for proj in projs.values() for prm in proj.parameters()], lr=cfg.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs * len(corpus.train))

    def checkpoint(epoch: int) -> Checkpoint:
        train_kl, _ = _evaluate(projs, corpus.train, recall=False)
        held_kl, recall = _evaluate(projs, corpus.held, recall=True)
        return Checkpoint(epoch, time.perf_counter() - t0, time.process_time() - c0, train_kl, held_kl, recall)

    curve = [checkpoint(0)]
    bar = tqdm(range(1, cfg.epochs + 1), desc="distill", disable=not progress)
    for epoch in bar:
        for j in torch.randperm(len(corpus.train), generator=gen).tolist():
            w = corpus.train[j]
            opt.zero_grad()
            for i in corpus.layers:  # the layers' indexers are independent: one graph in memory at a time
                (row_kl(w.p[i], indexer_row_logits(projs[i], w.hidden[i], w.rows)) / len(corpus.layers)).backward()
            opt.step()
            sched.step()
        curve.append(checkpoint(epoch))
        bar.set_postfix(kl=f"{curve[-1].train_kl:.3f}/{curve[-1].heldout_kl:.3f}")
    for proj in projs.values():
        proj.eval()
    held = [(w.p[i], w.rows) for w in corpus.held for i in corpus.layers]
    streaming = {d: sum(_streaming_recall(p, rows, d) for p, rows in held) / len(held) for d in DENSITIES}
    oracle = {d: sum(row_recall(p, p.float(), rows, d) for p, rows in held) / len(held) for d in DENSITIES}
    return DistillResult(projs, curve, streaming, oracle, corpus.split)


def distill(model: torch.nn.Module, tokenizer: Any, cfg: DistillConfig, layers: list[int] | None = None, *,
            progress: bool = True) -> DistillResult:
    """Dense warm-up of one indexer per layer of ``layers`` (default: the full-attention ones):
    :func:`collect` then :func:`fit`."""
    return fit(collect(model, tokenizer, cfg, layers, progress=progress), cfg, progress=progress)


def result_meta(result: DistillResult, cfg: DistillConfig, model_name: str) -> dict[str, Any]:
    """What the projections file and ``--json`` record: the model, the config, the layers, the
    curve, the streaming and oracle references and the split."""
    size = sum(prm.numel() for proj in result.projections.values() for prm in proj.parameters())
    return {"model": model_name, **dataclasses.asdict(cfg), "layers": sorted(result.projections), "parameters": size,
            "curve": [dataclasses.asdict(c) for c in result.curve], "streaming": result.streaming,
            "oracle": result.oracle, "split": result.split}


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


def _print_curve(label: str, result: DistillResult) -> None:
    print(f"indexer {label}: epoch | wall s | cpu s | KL train | KL held out | "
          + " | ".join(f"recall 1/{d}" for d in DENSITIES))
    for c in result.curve:
        print(f"{c.epoch} | {c.seconds:.0f} | {c.cpu_seconds:.0f} | {c.train_kl:.4f} | {c.heldout_kl:.4f} | "
              + " | ".join(f"{c.recall.get(d, math.nan):.4f}" for d in DENSITIES))
    for name, ref in (("streaming (4 sinks + recent)", result.streaming), ("oracle (exact top-k of p)", result.oracle)):
        print(f"{name} held-out recall: " + " | ".join(f"1/{d} {ref[d]:.4f}" for d in DENSITIES))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvsieve distill-indexer", description=plain(__doc__.split("\n\n")[0]))
    ap.add_argument("--model", default="smollm2", help="smollm2 | gemma3-270m | tiny-random | a checkpoint directory")
    ap.add_argument("--out", required=True, help="where to write the projections (torch.save file)")
    ap.add_argument("--layers", type=int, nargs="*", default=None, help="default: the full-attention layers")
    for f in dataclasses.fields(DistillConfig):
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    ap.add_argument("--grid", nargs="*", default=[], metavar="HEADSxDIM",
                    help="also train these geometries (e.g. 4x16 16x64) on the same captured windows; their "
                         "curves go to --json under 'grid' (recall against size)")
    ap.add_argument("--json", default=None, help="write the config, the curve and the split here")
    ap.add_argument("--captures", default=None, help="a folder keeping each window's captured targets for reruns")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from .model import load_model

    cfg = DistillConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DistillConfig)})
    bad = [g for g in args.grid if not re.fullmatch(r"[1-9][0-9]*x[1-9][0-9]*", g)]
    if bad:
        ap.error(f"--grid: expected HEADSxDIM such as 4x16, got {bad}")
    grid = [tuple(int(x) for x in g.split("x")) for g in args.grid]
    loaded = load_model(args.model)
    corpus = collect(loaded.model, loaded.tokenizer, cfg, args.layers, captures=args.captures and Path(args.captures))
    capture_cost = time.perf_counter() - corpus.start[0], time.process_time() - corpus.start[1]
    result = fit(corpus, cfg)
    meta = result_meta(result, cfg, loaded.name)
    save_projections(args.out, result.projections, meta)
    print(f"saved layers {meta['layers']} of index projections to {args.out}")
    _print_curve(f"{cfg.n_heads}x{cfg.head_dim}", result)
    meta["grid"] = []
    for heads, dim in grid:
        now = time.perf_counter() - capture_cost[0], time.process_time() - capture_cost[1]
        g_cfg = dataclasses.replace(cfg, n_heads=heads, head_dim=dim, rope_dim=min(cfg.rope_dim, dim))
        g = fit(dataclasses.replace(corpus, start=now), g_cfg)
        g_meta = result_meta(g, g_cfg, loaded.name)
        meta["grid"].append({k: g_meta[k] for k in ("n_heads", "head_dim", "rope_dim", "parameters", "curve")})
        _print_curve(f"{heads}x{dim} ({g_meta['parameters']} parameters)", g)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=2)
    return 0
