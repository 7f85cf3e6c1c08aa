"""Where one decode step's time goes: wall-clock timers around the stages of a layer.

The timers wrap callables for the duration of the profiled steps only (instance attributes or
module globals, restored afterwards), so the timed steps of :mod:`.e2e` run without them. Each
timer is inclusive; the exclusive stages are differences:

========================  =====================================================================
stage                     what (kvsieve)
========================  =====================================================================
``selector``              ``on_append`` + ``predict_kv`` + ``predict_attn`` of every layer's selector
``place+validate``        :func:`kvsieve.sparse.selector_step.place_rows` + ``SparseRuntimeParams.validate``
``gather``                the backend's K/V copies (the torch backend's ``ScratchPool.rows``, the SDPA
                          fast path's ``gather_blocks``); the index arithmetic around them counts as
                          attention
``attention``             the backend's ``forward`` minus its gather
``cache write``           ``KVCacheManager.write`` (plain: ``DynamicCache.update``, a concatenation)
``kvsieve python``        the integration's attention function minus the stages above
``projections``           the attention modules minus the attention function (q/k/v/o, RoPE)
``output layer``          ``lm_head``
``step metadata``         ``Engine.begin_step`` + ``end_step`` (once per step, not per layer)
``rest of model``         the step minus the attention modules, ``lm_head`` and the metadata (MLPs,
                          norms, embedding, the greedy argmax)
========================  =====================================================================

Every figure is milliseconds per decode step summed over the layers (the per-layer figure is
that over the number of layers).
"""
from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable

import torch

__all__ = ["StageTimers", "profile_kvsieve", "profile_plain", "render_profile", "STAGES"]

STAGES = ("selector", "place+validate", "gather", "attention", "cache write", "kvsieve python", "projections",
          "output layer", "step metadata", "rest of model")


class StageTimers:
    """Inclusive wall-clock seconds per named timer; :meth:`wrap` patches ``owner.attr`` until :meth:`restore`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._undo: list[Callable[[], None]] = []

    def timed(self, fn: Callable, name: str) -> Callable:
        """``fn`` adding its wall-clock seconds to timer ``name``."""
        seconds = self.seconds

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - t0

        return timed

    def wrap(self, owner: object, attr: str, name: str) -> None:
        timed = self.timed(getattr(owner, attr), name)
        had = attr in vars(owner) if hasattr(owner, "__dict__") else False
        old = vars(owner).get(attr) if had else None
        setattr(owner, attr, timed)
        self._undo.append(lambda: setattr(owner, attr, old) if had else delattr(owner, attr))

    def wrap_attention(self, name: str) -> None:
        """Time kvsieve's attention function (what transformers calls for each attention layer) as
        timer ``name``, by registering the timed function under kvsieve's attention implementation
        (restored to the plain one by :meth:`restore`)."""
        from transformers import AttentionInterface

        from kvsieve.integrations.transformers.hooks import ATTN_IMPLEMENTATION, attention_forward, register_attention

        AttentionInterface.register(ATTN_IMPLEMENTATION, self.timed(attention_forward, name))
        self._undo.append(register_attention)

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


def _steps(step: Callable[[torch.Tensor], torch.Tensor], tok: torch.Tensor, steps: int, timers: StageTimers) -> None:
    for _ in range(steps):
        t0 = time.perf_counter()
        tok = step(tok).argmax(-1)
        timers.seconds["step"] += time.perf_counter() - t0


def _model_parts(model: torch.nn.Module, timers: StageTimers) -> None:
    from kvsieve.integrations.transformers.hooks import attention_modules

    for m in attention_modules(model):
        timers.wrap(m, "forward", "attn_module")
    timers.wrap(model.lm_head, "forward", "lm_head")


def profile_kvsieve(session, tok: torch.Tensor, steps: int) -> dict[str, float]:
    """``steps`` greedy decode steps of ``session`` under the timers; ms per step per :data:`STAGES`."""
    import kvsieve.integrations.transformers.feature_backend as fb
    import kvsieve.sparse.selector_step as sa
    from kvsieve.sparse.backends.torch_backend.scratch import ScratchPool
    from kvsieve.sparse.params import SparseRuntimeParams

    t = StageTimers()
    try:
        _model_parts(session.model, t)
        t.wrap_attention("kvsieve_fn")
        t.wrap(session.engine, "begin_step", "metadata")
        t.wrap(session.engine, "end_step", "metadata")
        t.wrap(session.cache, "write", "write")
        t.wrap(session.backend, "forward", "backend")
        t.wrap(ScratchPool, "rows", "gather")  # the torch backend's K/V gathers (every pool: only this session runs)
        t.wrap(fb, "gather_blocks", "gather")
        t.wrap(sa, "place_rows", "place")
        t.wrap(SparseRuntimeParams, "validate", "place")
        for sel in {id(layer.plan.selector): layer.plan.selector for layer in session.layers if layer.plan}.values():
            for hook in ("on_append", "predict_kv", "predict_attn"):
                t.wrap(sel, hook, "selector")
        _steps(session.decode, tok, steps, t)
    finally:
        t.restore()
    s = {k: v * 1e3 / steps for k, v in t.seconds.items()}
    g = s.get
    out = {"selector": g("selector", 0.0), "place+validate": g("place", 0.0), "gather": g("gather", 0.0),
           "attention": g("backend", 0.0) - g("gather", 0.0), "cache write": g("write", 0.0)}
    out["kvsieve python"] = g("kvsieve_fn", 0.0) - g("write", 0.0) - g("selector", 0.0) - g("place", 0.0) - g("backend", 0.0)
    return _finish(out, s)


def profile_plain(model: torch.nn.Module, step: Callable[[torch.Tensor], torch.Tensor], tok: torch.Tensor,
                  steps: int) -> dict[str, float]:
    """The same for plain transformers ``sdpa`` (``step.cache`` its ``DynamicCache``)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    t = StageTimers()
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        AttentionInterface.register("sdpa", t.timed(sdpa, "sdpa"))
        _model_parts(model, t)
        t.wrap(step.cache, "update", "write")
        _steps(step, tok, steps, t)
    finally:
        t.restore()
        AttentionInterface.register("sdpa", sdpa)
    s = {k: v * 1e3 / steps for k, v in t.seconds.items()}
    out = {"selector": 0.0, "place+validate": 0.0, "gather": 0.0, "attention": s.get("sdpa", 0.0),
           "cache write": s.get("write", 0.0), "kvsieve python": 0.0}
    s["kvsieve_fn"] = s.get("sdpa", 0.0) + s.get("write", 0.0)  # the module's attention part
    return _finish(out, s)


def _finish(out: dict[str, float], s: dict[str, float]) -> dict[str, float]:
    g = s.get
    out["projections"] = g("attn_module", 0.0) - g("kvsieve_fn", 0.0)
    out["output layer"] = g("lm_head", 0.0)
    out["step metadata"] = g("metadata", 0.0)
    out["rest of model"] = g("step", 0.0) - g("attn_module", 0.0) - g("lm_head", 0.0) - g("metadata", 0.0)
    out["step"] = g("step", 0.0)
    return out


def render_profile(profile: dict[str, dict[str, float]], num_layers: int) -> list[str]:
    """A Markdown table: one row per stage, a column per configuration (ms per step, and per layer)."""
    names = list(profile)
    lines = ["| stage | " + " | ".join(f"{n} ms/step (per layer)" for n in names) + " |",
             "|---|" + "---:|" * len(names)]
    for stage in (*STAGES, "step"):
        cells = [f"{profile[n][stage]:.2f} ({profile[n][stage] / num_layers:.3f})" for n in names]
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    return lines
