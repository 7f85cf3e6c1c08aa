"""The selector base class: a name, a config dataclass, declared capabilities and two hooks.

A selector decides, per layer and step, which prompt tokens the cache keeps (``predict_kv``,
context phase) and which tokens or blocks each query attends (``predict_attn``). Either hook
may return ``None`` (nothing to do); a selector overrides at least one. Adding one is one file::

    @register_selector
    class MySelector(SparseSelector):
        name = "mine"
        config_class = MyConfig
        capabilities = Capabilities(phases={"generation"})
        budget = BudgetKnob("budget", unit="tokens")
        def predict_attn(self, inputs): ...

Phases: the layer asks ``predict_attn`` only about the query rows of the phases the selector
runs in this step (``inputs.rows``, ``inputs.phases``); rows of other phases stay dense without
the selector's help. ``predict_attn`` returns a carrier whose ``sparse_attn_offsets`` has
``len(rows) + 1`` entries (row ``0`` of the carrier is step row ``rows.start``); it may narrow
``selected_phases`` (e.g. RocketKV selects only generation rows and leaves context rows dense,
with empty segments). The optional ``predict_attn_naive`` is the plain-PyTorch reference of
``predict_attn``; the shared selector test checks every registered selector against it.

Sliding windows: on a layer whose queries see only their last ``window`` positions
(``inputs.window``), a selector that declares ``Capabilities(sliding_window=True)`` chooses only
among ``[kv_len - window, kv_len)``, through the helpers :meth:`SelectorInputs.window_starts`,
:meth:`SelectorInputs.mask_outside_window` and :meth:`SelectorInputs.clip_to_window` (all no-ops
without a window). A selector that does not declare it is refused on such a layer.

Installed mid-request: a selector whose hooks build per-token state (``on_append`` /
``on_compacted``, e.g. page summaries, indexer keys) has not seen the positions a request held
before the selector was installed (a dense prefill, then a sparse decode). The layer calls
:meth:`SparseSelector.on_attach` for such requests first; a selector that keeps such state and
does not override ``on_attach`` to rebuild it from the cache is refused (:func:`attach_refusal`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from ..kernels.decode_layer.plan import DecodeProgram, IndexerStep
from ..metadata import PHASES, AttentionMetadata, KVCacheManager
from .budget import BudgetKnob
from .params import SparseRuntimeParams

__all__ = ["Capabilities", "SelectorInputs", "SparseSelector", "PHASES", "ATTENTION_KINDS", "DEVICES"]

ATTENTION_KINDS = ("gqa", "mla")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Capabilities:
    """What a selector can serve: the phases it selects in, the attention kinds and devices it
    runs on, whether its ``predict_kv`` evicts prompt tokens, whether it restricts its choice
    to a sliding-window layer's window (``sliding_window``; see :attr:`SelectorInputs.window`), and
    whether its carrier asks the backend for skip-softmax thresholds (``skip_softmax``: a backend
    that does not run them is refused when the plan is set), and whether it decides each KV head
    from that head alone (``per_kv_head``: the selection, kept set and hints of KV head ``h`` read
    only K/V of head ``h``, the query heads of its group and per-token inputs, never another KV
    head; only such a selector runs on a tensor-parallel shard of a layer's heads, so the default
    ``False`` is refused there)."""

    phases: frozenset[str] = frozenset(PHASES)
    attention_kinds: frozenset[str] = frozenset({"gqa"})
    devices: frozenset[str] = frozenset(DEVICES)
    evicts: bool = False
    sliding_window: bool = False
    skip_softmax: bool = False
    per_kv_head: bool = False

    def __post_init__(self) -> None:
        for name, allowed in (("phases", PHASES), ("attention_kinds", ATTENTION_KINDS), ("devices", DEVICES)):
            values = frozenset(getattr(self, name))
            object.__setattr__(self, name, values)
            if not values or not values <= set(allowed):
                raise ValueError(f"Capabilities.{name} must be a non-empty subset of {list(allowed)}, got {sorted(values)}")


@dataclass
class SelectorInputs:
    """Everything a hook may read for one layer and step.

    ``q [num_tokens, num_q_heads, head_dim]``; GQA ``k``/``v [num_tokens, num_kv_heads,
    head_dim]`` (the step's new tokens, already in the cache); MLA ``k`` is the latent
    ``[num_tokens, kv_lora_rank + rope_dim]`` and ``v`` is ``None`` (all rows of the step).
    ``rows``: the step's query rows ``predict_attn`` is asked about (the rows of ``phases``, the
    phases the selector runs in this step, contiguous because context rows come first).
    ``model_inputs``: this step's per-step model inputs for the selector (of the type it declares
    in :attr:`SparseSelector.model_inputs_type`, e.g. DSA's indexer inputs), passed down by the
    caller with the step (``SparseAttention.forward(..., model_inputs=)``); ``None`` for a selector
    that declares none.
    ``window``: the layer's sliding window (a query whose ``kv_len`` is ``n`` attends only
    ``[n - window, n)``), ``None`` without one; a selector declaring
    ``Capabilities.sliding_window`` chooses only there (:meth:`window_starts`,
    :meth:`mask_outside_window`, :meth:`clip_to_window`).
    ``state``: scratch shared by the hooks of this one layer step (dropped after it).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor | None
    metadata: AttentionMetadata
    layer_idx: int
    num_kv_heads: int
    sm_scale: float
    attention_kind: str = "gqa"
    rows: slice = field(kw_only=True)
    phases: frozenset[str] = field(kw_only=True)
    model_inputs: Any = field(default=None, kw_only=True)
    window: int | None = field(default=None, kw_only=True)
    state: dict[str, Any] = field(default_factory=dict, repr=False)
    _keys: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def cache(self) -> KVCacheManager:
        return self.metadata.kv_cache_manager

    @property
    def num_q_heads(self) -> int:
        return self.q.shape[1]

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def num_rows(self) -> int:
        """Rows ``predict_attn`` answers for (``len(rows)``)."""
        return self.rows.stop - self.rows.start

    @property
    def requests(self) -> range:
        """Batch rows (requests) whose query tokens lie in :attr:`rows`."""
        md = self.metadata
        if not self.phases:
            return range(0)
        first = md.phase_requests("context" if "context" in self.phases else "generation")
        last = md.phase_requests("generation" if "generation" in self.phases else "context")
        return range(first.start, last.stop)

    @property
    def row_kv_lens(self) -> torch.Tensor:
        """Device int32 ``[num_rows]``: positions each query of :attr:`rows` may attend (the
        metadata's ``token_kv_lens`` covers every row of the step)."""
        return self.metadata.token_kv_lens[self.rows]

    def query_range(self, i: int) -> tuple[int, int]:
        """Token rows ``[start, end)`` of request ``i`` of the batch."""
        qs = self.metadata.query_start_host
        return int(qs[i]), int(qs[i + 1])

    def request_keys(self, i: int) -> torch.Tensor:
        """All valid keys of request ``i``: GQA ``[kv_len, num_kv_heads, head_dim]``; MLA latent ``[kv_len, R+P]``."""
        if i not in self._keys:
            rid = self.metadata.request_ids[i]
            self._keys[i] = self.cache.gather(self.layer_idx, rid)[0]
        return self._keys[i]

    def token_kv_lens_host(self) -> np.ndarray:
        """Host ``[num_tokens]``: positions each query token may attend (position + 1)."""
        return self.metadata.positions_host + 1

    # ---- the layer's sliding window (no-ops without one) -----------------------------------
    def window_starts(self, kv_lens: torch.Tensor) -> torch.Tensor:
        """int64, ``kv_lens``'s shape: the first position a query with that ``kv_len`` may attend,
        ``max(0, kv_len - window)`` (0 without a window)."""
        lens = torch.as_tensor(kv_lens).to(torch.int64)
        return torch.zeros_like(lens) if self.window is None else (lens - self.window).clamp_min(0)

    def mask_outside_window(self, scores: torch.Tensor, kv_lens: torch.Tensor, *, unit: int = 1,
                            fill: float | bool = float("-inf")) -> torch.Tensor:
        """``scores [*lead, *rest, N]`` over units of ``unit`` positions (unit ``j`` covers
        ``[j*unit, (j+1)*unit)``) with ``fill`` on every unit lying wholly before its row's window;
        ``kv_lens [*lead]`` are the rows' lengths. Unchanged without a window."""
        if self.window is None:
            return scores
        units = torch.arange(scores.shape[-1], device=scores.device)
        return scores.masked_fill(self._before_window(units, kv_lens, unit, scores.dim()), fill)

    def clip_to_window(self, sel: torch.Tensor, kv_lens: torch.Tensor, *, unit: int = 1) -> torch.Tensor:
        """``sel [*lead, *rest, k]`` unit ids (``-1`` = none) with ``-1`` on every unit lying wholly
        before its row's window (``kv_lens [*lead]``). Unchanged without a window."""
        if self.window is None:
            return sel
        return torch.where(self._before_window(sel, kv_lens, unit, sel.dim()), -1, sel).to(sel.dtype)

    def _before_window(self, units: torch.Tensor, kv_lens: torch.Tensor, unit: int, ndim: int) -> torch.Tensor:
        """Bool, broadcast to ``ndim`` dims: unit ids ``units`` lying wholly before the window of
        rows ``kv_lens [*lead]`` (leading dims)."""
        start = self.window_starts(kv_lens).to(units.device)
        return (units + 1) * unit <= start.view(*start.shape, *([1] * (ndim - start.dim())))


class SparseSelector:
    """Base class of every selector. Subclasses set the class attributes and override hooks."""

    name: ClassVar[str] = ""
    config_class: ClassVar[type] = object
    capabilities: ClassVar[Capabilities] = Capabilities()
    #: the config field that takes the selector's budget and the unit it counts (:mod:`.budget`);
    #: ``None``: the selector has no budget, and a budget in tokens or a density is refused for it
    budget: ClassVar[BudgetKnob | None] = None
    #: the type of the per-step model inputs the selector reads (:attr:`SelectorInputs.model_inputs`),
    #: which the caller must pass with every step; ``None``: it reads none, and the layer refuses any.
    model_inputs_type: ClassVar[type | None] = None

    def __init__(self, config: Any = None, **overrides: Any) -> None:
        if config is None:
            config = self.config_class(**overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} expects a {self.config_class.__name__}, got {type(config).__name__}")
        self.config = config

    # ---- configuration-time checks ------------------------------------------------------
    def check_support(self, *, phase: str | None = None, attention_kind: str | None = None,
                      device: str | torch.device | None = None, window: int | None = None) -> None:
        """Raise ``ValueError`` listing what is supported when a combination is not; ``window``: a
        sliding-window layer's window, which needs ``Capabilities.sliding_window`` and no eviction."""
        cap = self.capabilities
        if window is not None and cap.evicts:
            raise ValueError(f"selector {self.name!r} evicts prompt tokens, which a sliding-window layer (window "
                             f"{window}) cannot honour: eviction renumbers the positions the window is defined on")
        if window is not None and not cap.sliding_window:
            raise ValueError(f"selector {self.name!r} does not declare Capabilities(sliding_window=True), so it "
                             f"cannot run on a sliding-window layer (window {window}): it would choose among "
                             "positions the window never attends")
        dev = None if device is None else torch.device(device).type
        for what, value, allowed in (
            ("phase", phase, cap.phases), ("attention kind", attention_kind, cap.attention_kinds),
            ("device", dev, cap.devices),
        ):
            if value is not None and value not in allowed:
                raise ValueError(
                    f"selector {self.name!r} does not support {what} {value!r}; supported: {sorted(allowed)}"
                )

    # ---- hooks --------------------------------------------------------------------------
    def on_append(self, inputs: SelectorInputs) -> None:
        """Called after the step's K/V are written, before any prediction (e.g. page summaries)."""

    def predict_kv(self, inputs: SelectorInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Context phase: ``(sparse_kv_indices [Hkv, total_kept], sparse_kv_offsets [num_contexts+1])`` or ``None``."""
        return None

    def predict_attn(self, inputs: SelectorInputs) -> SparseRuntimeParams | None:
        """Which tokens/blocks each query of ``inputs.rows`` attends (or kernel hints), or ``None``
        for dense; offsets cover ``inputs.num_rows`` rows."""
        return None

    #: optional plain-PyTorch reference of :meth:`predict_attn` (same signature and result);
    #: ``None`` when the selector has none. Checked for every registered selector by one test.
    predict_attn_naive: ClassVar[Any] = None
    #: optional plain-PyTorch reference of :meth:`predict_kv`, likewise.
    predict_kv_naive: ClassVar[Any] = None

    def on_compacted(self, inputs: SelectorInputs, kept: list[torch.Tensor]) -> None:
        """Called after this layer's cache was compacted (``kept[i]``: ``[Hkv, n_keep]`` of context ``i``)."""

    def on_attach(self, inputs: SelectorInputs, requests: np.ndarray) -> None:
        """Called before the step's K/V are written, at the selector's first step with requests
        whose earlier positions it never saw: ``requests`` (int64 ``[n]``, indices into the step's
        requests) each hold positions ``[0, kv_len - q_len)`` in the cache from before the selector
        was installed. Rebuild from the cache the state :meth:`on_append` would have built for
        them. The default does nothing; :func:`attach_refusal` refuses a selector that keeps
        such state without overriding this."""

    # ---- the native decode step (optional) ---------------------------------------------
    def decode_program(self, cache: KVCacheManager, layer_idx: int, head_dim: int) -> DecodeProgram | None:
        """This selector's decode rows (one new token per request, no sliding window) as a program of
        :mod:`kvsieve.kernels.decode_layer`: its per-step state update (``on_append``'s, on the same
        pools), ``predict_attn``'s choice and the attention in one native call per layer. ``None``
        (the default): this selector or this config has none, and the layer runs the hooks."""
        return None

    def decode_step_inputs(self, layer_idx: int, model_inputs: Any, positions: torch.Tensor) -> IndexerStep | None:
        """A program that reads per-step model inputs (:attr:`model_inputs_type`): the step's inputs
        for it from ``model_inputs`` (this layer's, the rows' order) and ``positions [N]`` int64 (each
        row's new token). ``None`` for programs that read none."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"


_STATE_HOOKS = ("on_append", "on_compacted")


def attach_refusal(selector: SparseSelector) -> str | None:
    """Why ``selector`` cannot be installed on requests that already hold positions, or ``None``
    when it can: it keeps per-token state (overrides ``on_append`` or ``on_compacted``) and has no
    :meth:`SparseSelector.on_attach` to rebuild that state from the cache."""
    cls = type(selector)
    stateful = [h for h in _STATE_HOOKS if getattr(cls, h) is not getattr(SparseSelector, h)]
    if not stateful or cls.on_attach is not SparseSelector.on_attach:
        return None
    return (f"selector {selector.name!r} builds per-token state in {' and '.join(stateful)} and cannot rebuild "
            "it for positions cached before it was installed (no on_attach); install it before the prefill")
