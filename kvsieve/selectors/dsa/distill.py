"""The dense warm-up of DSA's indexer (DeepSeek-V3.2 tech report), for a model without a trained
one. The model is frozen; per layer an :class:`~.projections.IndexerProjections` (from the
layer's attention-input hidden state) is trained to minimise ``KL(p || softmax(I))``, where ``p``
is the layer's dense attention averaged over its query heads and ``I`` the indexer logits.

Training runs at the evaluation length, or at several (``seq_len`` a tuple: the same windows at
each length, one indexer for all): each window of ``seq_len`` tokens is run once through the frozen
model, and for ``rows`` query positions sampled per window (each scored against every
key it sees) the targets ``p`` are kept with the layer's hidden states (:mod:`.distill_targets`),
so memory grows with ``rows x seq_len``, not ``seq_len**2``. The windows come from the harness's
corpus (:attr:`kvsieve.sparse.CalibrationContext.documents`: essays and other text) with a recorded
train / held-out split, plus retrieval windows (:mod:`.distill_retrieval`). The loss of a window is
its KL averaged over its ``rows`` sampled rows, and every window has the same ``rows``: every
sampled row weighs the same, whatever its window's length. After every epoch the KL on the
training and held-out windows and the held-out recall at densities 1/4, 1/16, 1/64 (the dense mass
the indexer's top-k keeps), per window length and their mean, are recorded with the elapsed wall
and CPU time.

Run by the ``distill_indexer`` calibration step (:mod:`.calibration`) and by ``kvsieve distill-indexer``
(:mod:`kvsieve.eval.distill_indexer`); the model runs through the harness's capture
(:class:`~kvsieve.sparse.CalibrationContext`), never imported here.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ...sparse.calibration import CalibrationContext
from ..common.text_windows import split_documents, token_windows
from .distill_config import DistillConfig
from .distill_retrieval import retrieval_windows
from .distill_targets import WindowTargets, cached_capture, sample_rows, trainable_layers, window_targets
from .projections import IndexerProjections

__all__ = ["Checkpoint", "DistillResult", "Corpus", "REDUCTION_FACTORS", "collect", "fit", "distill", "result_meta",
           "rope_theta", "indexer_row_logits", "row_kl", "row_recall"]

#: the reduction factors of the held-out recall: densities 1/4, 1/16, 1/64 (budget = ceil(context / factor) per
#: query row)
REDUCTION_FACTORS = (4, 16, 64)


@dataclass(frozen=True)
class Checkpoint:
    """After ``epoch`` epochs (0 = untrained), ``seconds`` wall and ``cpu_seconds`` process CPU
    since :func:`distill` began (captures included): mean KL on the training and held-out
    windows and the held-out recall per reduction factor (:data:`REDUCTION_FACTORS`): ``recall``
    the mean over the window lengths, ``recall_by_length`` per length."""

    epoch: int
    seconds: float
    cpu_seconds: float
    train_kl: float
    heldout_kl: float
    recall: dict[int, float]  # by reduction factor
    recall_by_length: dict[int, dict[int, float]]  # window length -> reduction factor -> recall


@dataclass(frozen=True)
class DistillResult:
    """The trained ``projections`` per layer, the training ``curve``, the held-out recall per
    reduction factor of ``streaming`` (4 sinks + recent window, for comparison) and of the ``oracle`` (the
    exact top positions of ``p``: the ceiling of any one set of positions shared by the query heads,
    as the indexer's is), each the mean over the window lengths and ``*_by_length`` per length, and
    the document ``split``."""

    projections: dict[int, IndexerProjections]
    curve: list[Checkpoint]
    streaming: dict[int, float]
    oracle: dict[int, float]
    streaming_by_length: dict[int, dict[int, float]]
    oracle_by_length: dict[int, dict[int, float]]
    split: dict[str, list[str]]


def rope_theta(cfg: Any) -> float:
    """The RoPE base of a transformers text config (of its full-attention layers where they differ)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if "full_attention" in params:  # per layer type (Gemma 3)
        params = params["full_attention"]
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


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


def row_recall(p: torch.Tensor, scores: torch.Tensor, rows: torch.Tensor, reduction_factor: int) -> float:
    """Mean over rows of the mass ``p [R, S]`` kept by the top ``ceil((row + 1) / reduction_factor)``
    positions of ``scores [R, S]`` (``-inf`` past each row)."""
    kept = []
    for r, t in enumerate(rows.tolist()):
        k = -(-(t + 1) // reduction_factor)
        kept.append(float(p[r].float()[scores[r, : t + 1].topk(k).indices].sum()))
    return sum(kept) / len(kept)


def _streaming_recall(p: torch.Tensor, rows: torch.Tensor, reduction_factor: int, num_sink: int = 4) -> float:
    kept = []
    for r, t in enumerate(rows.tolist()):
        k = -(-(t + 1) // reduction_factor)
        recent = p[r, max(num_sink, t + 1 - (k - num_sink)): t + 1].float().sum()
        kept.append(float(p[r, :num_sink].float().sum() + recent))
    return sum(kept) / len(kept)


def _evaluate(projs: dict[int, IndexerProjections], windows: list[WindowTargets], recall: bool
              ) -> tuple[float, dict[int, dict[int, float]]]:
    """Mean KL over ``windows`` x layers and, with ``recall``, the mean recall by window length,
    then reduction factor."""
    kls, kept = [], {}
    with torch.no_grad():
        for w in windows:
            for i, proj in projs.items():
                logits = indexer_row_logits(proj, w.hidden[i], w.rows)
                kls.append(float(row_kl(w.p[i], logits)))
                for d in REDUCTION_FACTORS if recall else ():
                    kept.setdefault(w.seq_len, {}).setdefault(d, []).append(row_recall(w.p[i], logits, w.rows, d))
    return sum(kls) / len(kls), {n: {d: sum(v) / len(v) for d, v in by.items()} for n, by in kept.items()}


def _mean_over_lengths(by_length: dict[int, dict[int, float]]) -> dict[int, float]:
    return {d: sum(r[d] for r in by_length.values()) / len(by_length) for d in REDUCTION_FACTORS}


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


def collect(ctx: CalibrationContext, cfg: DistillConfig, *, progress: bool = True, captures: Path | None = None
            ) -> Corpus:
    """Capture the training and held-out windows of ``cfg`` (the expensive, geometry-free part) on
    ``ctx.layers`` (default: the full-attention ones), the training windows followed by
    ``cfg.retrieval_seqs`` retrieval windows (:mod:`.distill_retrieval`); with ``captures`` (a
    folder) each window's targets are kept there (:func:`cached_capture`, keyed by the model's
    weights, the tokens, the layers and the rows) and reused by a rerun."""
    start = time.perf_counter(), time.process_time()
    model, tokenizer = ctx.model, ctx.tokenizer
    layers = trainable_layers(model.config, ctx.layers)
    for prm in model.parameters():
        prm.requires_grad_(False)
    train_docs, held_docs = split_documents(ctx.documents(), cfg.holdout_every)
    gen = torch.Generator().manual_seed(cfg.seed)
    key = {"model": ctx.weights_hash(), "layers": layers} if captures is not None else {}

    def window(ids: torch.Tensor, rows: torch.Tensor, path: Path | None) -> WindowTargets:
        def capture() -> dict[str, Any]:
            t = window_targets(ctx.capture(ids, layers, rows), rows)
            return {"hidden": t.hidden, "p": t.p}

        saved = cached_capture(path, key | {"ids": ids, "rows": rows}, capture)
        return WindowTargets(rows, {int(i): h for i, h in saved["hidden"].items()},
                             {int(i): p for i, p in saved["p"].items()})

    def targets(windows, desc, name, seq_len):  # windows: (ids [1, seq_len], rows always sampled at the end)
        return [window(ids, sample_rows(seq_len, cfg.rows, gen, tail),
                       captures and Path(captures) / f"{name}-{seq_len}-{j}.pt")
                for j, (ids, tail) in enumerate(tqdm(windows, desc=f"{desc} ({seq_len})", disable=not progress))]

    # every window of every length is cut before the first capture, so a corpus too short for them
    # is refused at once (naming the length), not after the captures (an hour of CPU for Gemma 3 at 16K)
    cut = {}
    for n in cfg.lengths:
        kind = "training"
        try:
            prose = token_windows(tokenizer, train_docs, n, cfg.num_seqs)
            kind = "held-out"
            held_out = token_windows(tokenizer, held_docs, n, cfg.heldout_seqs)
            kind = "retrieval"  # from the training essays only; every row of the question/answer tail is sampled
            made = (retrieval_windows(tokenizer, train_docs, n, cfg.retrieval_seqs, cfg.retrieval_facts, cfg.seed)
                    if cfg.retrieval_seqs else [])
        except ValueError as e:
            raise ValueError(f"distill: the {kind} windows at seq_len {n}: {e}") from e
        cut[n] = prose, held_out, made
    train, held = [], []
    for n, (prose, held_out, made) in cut.items():
        train += targets([(ids, 1) for ids in prose], "train targets", "train", n)
        held += targets([(ids, 1) for ids in held_out], "held out", "held", n)
        train += targets([(w.ids, n - w.tail_start) for w in made], "retrieval targets", "retrieval", n)
    text = getattr(model.config, "text_config", model.config)
    split = {"train": [f"{d.source}/{d.name}" for d in train_docs], "held_out": [f"{d.source}/{d.name}" for d in held_docs]}
    return Corpus(train, held, layers, text.hidden_size, rope_theta(text), split, start)


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
        held_kl, by_length = _evaluate(projs, corpus.held, recall=True)
        return Checkpoint(epoch, time.perf_counter() - t0, time.process_time() - c0, train_kl, held_kl,
                          _mean_over_lengths(by_length), by_length)

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
    streaming, oracle = {}, {}
    for n in sorted({w.seq_len for w in corpus.held}):
        held = [(w.p[i], w.rows) for w in corpus.held if w.seq_len == n for i in corpus.layers]
        streaming[n] = {d: sum(_streaming_recall(p, rows, d) for p, rows in held) / len(held)
                        for d in REDUCTION_FACTORS}
        oracle[n] = {d: sum(row_recall(p, p.float(), rows, d) for p, rows in held) / len(held)
                     for d in REDUCTION_FACTORS}
    return DistillResult(projs, curve, _mean_over_lengths(streaming), _mean_over_lengths(oracle), streaming, oracle,
                         corpus.split)


def distill(ctx: CalibrationContext, cfg: DistillConfig, *, progress: bool = True) -> DistillResult:
    """Dense warm-up of one indexer per layer of ``ctx.layers`` (default: the full-attention ones):
    :func:`collect` then :func:`fit`."""
    return fit(collect(ctx, cfg, progress=progress), cfg, progress=progress)


def result_meta(result: DistillResult, cfg: DistillConfig, model_name: str) -> dict[str, Any]:
    """What the projections file and ``--json`` record: the model, the config, the layers, the
    curve, the streaming and oracle references and the split."""
    size = sum(prm.numel() for proj in result.projections.values() for prm in proj.parameters())
    return {"model": model_name, **dataclasses.asdict(cfg), "layers": sorted(result.projections), "parameters": size,
            "curve": [dataclasses.asdict(c) for c in result.curve], "streaming": result.streaming,
            "oracle": result.oracle, "streaming_by_length": result.streaming_by_length,
            "oracle_by_length": result.oracle_by_length, "split": result.split}
