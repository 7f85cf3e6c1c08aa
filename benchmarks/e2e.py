"""``e2e``: greedy decode tokens/s through the transformers integration, against plain transformers.

One seeded random prompt of the longest length is prefilled **once** through a
:class:`~kvsieve.integrations.transformers.KvsieveSession` whose selector keeps its page summaries
up to date during the prefill (the selectors timed here select in the generation phase only, so
their prefill is the dense one). Each length (``--lengths``, default 4K, 8K, 16K, 32K, and the
floor's 128 tokens), longest first, is that cache rewound to the length (a causal prefix is exactly
its own prefill). From there, side by side:

* ``quest`` (each ``selectors`` entry) at ``budget = length / reduction_factor``, torch backend;
* ``kvsieve_dense``: the same session with no selector;
* ``plain``: plain transformers ``sdpa`` decoding from a ``DynamicCache`` holding exactly the K/V of
  the kvsieve cache (post-RoPE keys; so the three decode from the same state).

The configurations are timed **interleaved**: a round is one greedy decode step of each
configuration, every step from the same state (the session rewinds to the length, the plain cache
is cropped back), so a neighbour's load moves all of them alike. ``warmup`` untimed rounds, then
``steps`` timed ones; tokens/s = 1 / median step time. The **floor** is plain transformers at the
floor length (128 tokens: weights-bound). Then ``profile_steps`` rounds run under the stage timers
of :mod:`.e2e_profile` (the timed rounds run without them). ``peak_rss_mb`` is the process's
resident high-water mark (``VmHWM``, reset when the length starts) while that length ran, with
kvsieve's pool sized for the longest length; ``rss_mb`` the resident set at its end.

Contexts longer than ``prefill_max`` (default 16K) are not prefilled: the prefilled blocks are
repeated (K/V and the selectors' auxiliary pools) up to the length (``KvsieveSession.tile_context``),
which times the same work as a real context of that length without its quadratic prefill (minutes at
32K on a CPU).

Speed only: the prompt is random token ids, and the model (SmolLM2-135M, 8K positions trained) is
run past its trained length at 16K/32K; the tokens it produces are not looked at.
``--quick`` runs a tiny random Llama at 32/64 tokens (what the tests run).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvsieve.eval.memory import reset_peak_rss, rss_mb
from kvsieve.integrations.transformers import ATTN_IMPLEMENTATION

from ._timing import Timing, load_average, load_averages
from .e2e_profile import profile_kvsieve, profile_plain
from .e2e_report import DENSE, PLAIN, render_markdown, targets

__all__ = ["E2EConfig", "run", "main"]


@dataclass(frozen=True)
class E2EConfig:
    """One e2e run: ``lengths`` (tokens of context), ``floor_length``, ``steps`` timed and ``warmup``
    untimed decode steps per configuration, ``profile_steps`` under the stage timers, the
    ``selectors`` at ``budget = length // reduction_factor`` (``page_size`` tokens per page), the
    ``model`` (a :func:`kvsieve.eval.model.load_model` spec) and the kvsieve ``backend``."""

    lengths: tuple[int, ...] = (4096, 8192, 16384, 32768)
    floor_length: int = 128
    steps: int = 8
    warmup: int = 2
    profile_steps: int = 3
    reduction_factor: int = 16
    page_size: int = 16
    selectors: tuple[str, ...] = ("quest",)
    model: str = "smollm2"
    backend: str = "torch"
    seed: int = 0
    prefill_max: int = 16384

    def __post_init__(self) -> None:
        for name in ("steps", "warmup", "profile_steps", "reduction_factor", "page_size", "floor_length", "prefill_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name in ("warmup", "profile_steps") else 1):
                raise ValueError(f"E2EConfig.{name} must be an int >= {0 if name in ('warmup', 'profile_steps') else 1}, "
                                 f"got {v!r}")
        if not self.lengths or any(n < self.page_size for n in self.lengths):
            raise ValueError(f"E2EConfig.lengths must be non-empty, each >= page_size={self.page_size}, "
                             f"got {self.lengths}")
        if self.prefill_max % self.page_size:
            raise ValueError(f"E2EConfig.prefill_max must be a multiple of page_size={self.page_size} (the tiled "
                             f"context repeats whole blocks), got {self.prefill_max}")
        unknown = set(self.selectors) - set(SELECTOR_CONFIGS)
        if unknown:
            raise ValueError(f"E2EConfig.selectors: {sorted(unknown)} not timed here; one of {sorted(SELECTOR_CONFIGS)}")


def _quest(length: int, cfg: E2EConfig) -> dict:
    return {"budget": max(length // cfg.reduction_factor, cfg.page_size), "page_size": cfg.page_size}


#: selector -> its config at a context length (selectors acting in the generation phase only)
SELECTOR_CONFIGS = {"quest": _quest}
QUICK = E2EConfig(lengths=(64,), floor_length=32, steps=2, warmup=1, profile_steps=1, model="tiny-random",
                  prefill_max=32)


def _timing(times: list[float]) -> Timing:
    times = sorted(times)
    q = statistics.quantiles(times, n=4) if len(times) >= 4 else [times[0], 0.0, times[-1]]
    return Timing(median_s=statistics.median(times), min_s=times[0], max_s=times[-1], q1_s=q[0], q3_s=q[2],
                  reps=len(times), warmup=0, load_1m=load_average())


def _plain_cache(session, length: int):
    """A transformers ``DynamicCache`` with the K/V of the session's first request, ``[1, Hkv, L, D]``
    per layer (copies, so the session's later steps do not change it)."""
    from transformers import DynamicCache

    from kvsieve.integrations.transformers import gather_request_kv

    cache = DynamicCache()
    for layer in range(session.num_layers):
        k, v = gather_request_kv(session.cache, layer, 0, head_major=True)
        cache.update(k[None, :, :length].clone(), v[None, :, :length].clone(), layer)
    return cache


class _Plain:
    """Plain transformers (``sdpa``) decoding one token at position ``length`` from ``cache``, which
    is cropped back to ``length`` tokens after each step."""

    def __init__(self, model, cache, length: int) -> None:
        self.model, self.cache, self.length = model, cache, length

    @torch.inference_mode()
    def __call__(self, tok: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tok.view(1, 1), position_ids=torch.tensor([[self.length]]),
                          past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits[:, -1]

    def reset(self) -> None:
        self.cache.crop(-1)


def _one_length(session, plans: dict[str, list], tok: torch.Tensor, length: int, cfg: E2EConfig,
                profile: bool) -> dict:
    """The session rewound to ``length`` (a prefix of the prompt: exactly its own prefill), every
    configuration timed interleaved from there."""
    session.rewind(length)
    row: dict = {"length": length, "load_1m_start": load_average()}
    reset_peak_rss()
    plain = _Plain(session.model, _plain_cache(session, length), length)
    steps = _Steps(session, plans, plain)
    times = steps.rounds(tok, cfg.warmup, cfg.steps)
    row["step"] = {k: _timing(v).as_dict() for k, v in times.items()}
    row["attended_fraction"] = steps.attended
    row["profile"] = steps.profile(tok, cfg.profile_steps) if profile and cfg.profile_steps else {}
    steps.close()
    row["tokens_per_s"] = {k: 1.0 / v["median_s"] for k, v in row["step"].items()}
    row["peak_rss_mb"], row["rss_mb"] = rss_mb()
    row["load_1m_end"] = load_average()
    return row


class _Steps:
    """One decode step of each configuration in turn (a round), every step from the same state: the
    kvsieve session rewinds to the prompt and the plain cache is cropped back after each step, so
    the configurations are measured interleaved in time, at the same context length."""

    def __init__(self, session, plans: dict[str, list], plain: _Plain) -> None:
        self.session, self.plans, self.plain = session, plans, plain
        self.length = session.num_cached_positions
        self.attended: dict[str, float | None] = {}
        # each configuration its own layer objects, its plans installed once: a plan installed
        # anew must rebuild its selector's state from the cache (SparseSelector.on_attach), which
        # a session running only that configuration would do once, not every step
        self.own_layers = {}
        for name, layer_plans in plans.items():
            layers = [copy.copy(layer) for layer in session.layers]
            for layer, plan in zip(layers, layer_plans):
                layer.plan = plan
            self.own_layers[name] = layers
        self.original_layers = list(session.layers)

    def _use(self, name: str) -> None:
        """The layers holding ``name``'s plans (as ``set_config`` lowered them) become the session's."""
        self.session.layers[:] = self.own_layers[name]
        self.session.reset_stats()

    def close(self) -> None:
        """The session's own layers back."""
        self.session.layers[:] = self.original_layers

    def _kvsieve_done(self, name: str) -> None:
        frac = [f for f in self.session.attended_fraction("generation") if f is not None]
        self.attended[name] = sum(frac) / len(frac) if frac else None
        self.session.rewind(self.length)

    def rounds(self, tok: torch.Tensor, warmup: int, steps: int) -> dict[str, list[float]]:
        """Seconds of each timed step per configuration (``warmup`` untimed rounds first)."""
        times: dict[str, list[float]] = {name: [] for name in [*self.plans, PLAIN]}
        for r in range(warmup + steps):
            for name in self.plans:
                self._use(name)
                t0 = time.perf_counter()
                self.session.decode(tok)
                dt = time.perf_counter() - t0
                self._kvsieve_done(name)
                if r >= warmup:
                    times[name].append(dt)
            self.session.model.set_attn_implementation("sdpa")
            t0 = time.perf_counter()
            self.plain(tok)
            dt = time.perf_counter() - t0
            self.plain.reset()
            self.session.model.set_attn_implementation(ATTN_IMPLEMENTATION)
            if r >= warmup:
                times[PLAIN].append(dt)
        return times

    def profile(self, tok: torch.Tensor, steps: int) -> dict[str, dict[str, float]]:
        """ms per step per stage (:mod:`.e2e_profile`), one profiled step per configuration per round."""
        acc: dict[str, dict[str, float]] = {}
        for _ in range(steps):
            for name in self.plans:
                self._use(name)
                _add(acc, name, profile_kvsieve(self.session, tok, 1))
                self._kvsieve_done(name)
            self.session.model.set_attn_implementation("sdpa")
            _add(acc, PLAIN, profile_plain(self.session.model, self.plain, tok, 1))
            self.plain.reset()
            self.session.model.set_attn_implementation(ATTN_IMPLEMENTATION)
        return {name: {k: v / steps for k, v in stages.items()} for name, stages in acc.items()}


def _add(acc: dict[str, dict[str, float]], name: str, stages: dict[str, float]) -> None:
    into = acc.setdefault(name, {})
    for k, v in stages.items():
        into[k] = into.get(k, 0.0) + v


def _load(cfg: E2EConfig):
    from kvsieve.eval.model import load_model

    loaded = load_model(cfg.model)
    model = loaded.model.eval()
    return model, model.config.vocab_size, loaded.name


def native_kernels_status() -> dict[str, str]:
    """Per native CPU kernel, what this process runs: ``"native"`` or ``"torch (<why>)"``."""
    from kvsieve.kernels.common.native import native_status
    from kvsieve.kernels.head_tables import native as head_tables
    from kvsieve.kernels.page_minmax import native as page_minmax
    from kvsieve.kernels.page_topk import native as page_topk
    from kvsieve.kernels.segment_check import native as segment_check
    from kvsieve.kernels.sparse_gqa_decode import native as sparse_decode

    return {"page_topk": native_status(page_topk.SOURCE), "sparse_decode": native_status(sparse_decode.SOURCE),
            "segment_check": native_status(segment_check.SOURCE), "head_tables": native_status(head_tables.SOURCE),
            "page_minmax": native_status(page_minmax.SOURCE)}


def run(cfg: E2EConfig, profile: bool = True) -> dict:
    """Every length of ``cfg`` and the floor from one prefill of the longest (lengths descending, each
    a rewind); ratios of each configuration to plain transformers at the same length, to the floor
    and to kvsieve dense."""
    from kvsieve import SparseAttentionConfig
    from kvsieve.integrations.transformers import KvsieveSession

    model, vocab, name = _load(cfg)
    lengths = sorted({cfg.floor_length, *cfg.lengths}, reverse=True)
    out: dict = {"config": {**asdict(cfg), "lengths": list(cfg.lengths)}, "model_name": name,
                 "num_layers": model.config.num_hidden_layers, "native_kernels": native_kernels_status(),
                 "loadavg_start": load_averages(), "rows": []}
    gen = torch.Generator().manual_seed(cfg.seed)
    ids = torch.randint(0, vocab, (1, lengths[0]), generator=gen)

    def config(s: str, length: int) -> SparseAttentionConfig | None:
        return None if s == DENSE else SparseAttentionConfig(s, SELECTOR_CONFIGS[s](length, cfg))

    # the first selector's state (Quest's page summaries, in the cache's aux pools, which each
    # length's freshly lowered plans find again) is built by the prefill
    with KvsieveSession(model, config(cfg.selectors[0], lengths[0]) if cfg.selectors else None, backend=cfg.backend,
                        max_tokens=lengths[0] + 2) as session:
        real = min(lengths[0], cfg.prefill_max)
        t0 = time.perf_counter()
        tok = session.prefill(ids[:, :real]).argmax(-1)
        out["prefill"] = {"length": real, "seconds": time.perf_counter() - t0, "tiled_to": lengths[0]}
        if lengths[0] > real:
            session.tile_context(lengths[0])
        for length in lengths:  # budgets follow the length: each lowers its own plans
            plans = {}
            for s in [*cfg.selectors, DENSE]:
                session.set_config(config(s, length))
                plans[s] = [layer.plan for layer in session.layers]
            out["rows"].append(_one_length(session, plans, tok, length, cfg, profile))
    out["rows"].sort(key=lambda r: r["length"])
    floor = next(r for r in out["rows"] if r["length"] == cfg.floor_length)
    out["floor_tokens_per_s"] = floor["tokens_per_s"][PLAIN]
    for r in out["rows"]:
        tps = r["tokens_per_s"]
        r["vs_plain"] = {k: v / tps[PLAIN] for k, v in tps.items()}
        r["vs_floor"] = {k: v / out["floor_tokens_per_s"] for k, v in tps.items()}
        r["vs_dense"] = {k: v / tps[DENSE] for k, v in tps.items()}
    out["loadavg_end"] = load_averages()
    out["targets"] = targets(out)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny random Llama at 32/64 tokens (seconds)")
    ap.add_argument("--lengths", type=int, nargs="+", help="context lengths (default 4096 8192 16384 32768)")
    ap.add_argument("--steps", type=int, help="timed decode steps per configuration (default 8)")
    ap.add_argument("--prefill-max", type=int, help="real prefill at most this long; longer contexts tile it "
                                                    "(default 16384)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--no-profile", action="store_true", help="skip the per-layer stage profile")
    ap.add_argument("--out", help="write the JSON result here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = config_from(args.quick, args.lengths, args.steps, args.prefill_max)
    res = run(cfg, profile=not args.no_profile)
    print("\n".join(render_markdown(res)))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


def config_from(quick: bool, lengths: list[int] | None, steps: int | None, prefill_max: int | None = None
                ) -> E2EConfig:
    """The run's config: :data:`QUICK` or the default, with ``lengths``/``steps``/``prefill_max`` when given."""
    base = QUICK if quick else E2EConfig()
    over = {k: v for k, v in (("lengths", tuple(lengths) if lengths else None), ("steps", steps),
                              ("prefill_max", prefill_max)) if v is not None}
    return E2EConfig(**{**asdict(base), **over})


if __name__ == "__main__":
    main(sys.argv[1:])
