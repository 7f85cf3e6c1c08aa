"""``SparseAttention``: one layer of a step — append, predict, attend, compact — returning what it did.

Order within ``forward`` for one step:

0. ``selector.on_attach`` for requests that held positions before the plan was installed (a
   selector that keeps per-token state and cannot rebuild it is refused here, before anything is
   written: :func:`~.selector_base.attach_refusal`);
1. write the step's K/V into the paged cache;
2. ``selector.on_append`` (e.g. page summaries), every step;
3. the phases the selector runs in are the plan's phases present this step
   (:meth:`AttentionMetadata.phases`); their rows (context first, so contiguous) are
   ``inputs.rows``;
4. context phase among them: ``selector.predict_kv`` picks the prompt tokens to keep;
5. ``selector.predict_attn`` answers for ``inputs.rows`` only; the layer places the answer in
   the step's rows (other rows: empty segments, outside ``selected_phases``, dense, and no
   skip-softmax) and validates it (``debug``, default on);
6. the backend computes attention and returns an :class:`~.backends.AttentionResult`;
7. if tokens were evicted, this layer's pool is compacted in place *after* the attention (the
   prompt's own causal attention still sees the whole prompt, as in RocketKV/SnapKV), and the
   new per-request length is recorded in :attr:`AttentionMetadata.pending_kv_lens` for the engine
   to commit once every layer is done (:func:`commit_evictions`): the ledger length is shared.

``forward`` returns a :class:`LayerOutput` (output, LSE, the placed params, :class:`LayerStats`,
the backend's paths); a model integration that cannot pass it through the model's code hands it
to its observers (:data:`kvsieve.integrations.transformers.LayerObserver`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..metadata import AttentionMetadata
from .selector_base import SelectorInputs, attach_refusal
from .backends import AttentionBackend, AttentionGeometry, default_backend, get_backend
from .config import LayerPlan
from .knobs import check_value
from .params import SparseRuntimeParams
from .selector_step import check_model_inputs, run_selector, selector_inputs
from .window import window_params

__all__ = ["SparseAttention", "LayerOutput", "LayerStats", "SelectorRecord", "commit_evictions"]


@dataclass(frozen=True)
class LayerStats:
    """What one forward really did: attended vs. dense positions (summed over tokens x KV heads)."""

    attended: int
    dense: int
    kept_after_eviction: int | None = None
    skipped_tiles: int = 0
    walked_tiles: int = 0

    @property
    def attended_fraction(self) -> float:
        return self.attended / self.dense if self.dense else 1.0

    @property
    def computed_fraction(self) -> float:
        """Fraction of attended positions whose softmax and P.V ran (skip-softmax skips tiles)."""
        skipped = self.skipped_tiles / self.walked_tiles if self.walked_tiles else 0.0
        return self.attended_fraction * (1.0 - skipped)


@dataclass(frozen=True)
class LayerOutput:
    """The result of :meth:`SparseAttention.forward`.

    ``out [T, Hq, Dv]`` (q's dtype); ``lse [T, Hq]`` fp32 or ``None`` (a backend path without
    LSE); ``params``: what the selector decided, placed in the step's rows (``None`` = dense);
    ``stats``; ``paths``: phase -> kernel path the backend took.
    """

    out: torch.Tensor
    lse: torch.Tensor | None
    params: SparseRuntimeParams | None
    stats: LayerStats
    paths: dict[str, str]


@dataclass(frozen=True)
class SelectorRecord:
    """What a layer records about its plan's selector between steps (:meth:`SparseAttention.record`):
    the live requests whose positions the selector has seen and the blocks whose per-block state
    (page summaries, index keys) it built (``None`` before its first step). The per-block state
    itself lives in the cache's auxiliary pools, which the cache snapshot covers."""

    attached: frozenset[int]
    seen_blocks: np.ndarray | None


class SparseAttention:
    """Runs one layer's selector then backend. GQA: q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``;
    MLA (absorbed): q ``[T, H, R+P]``, k = latent ``[T, R+P]``, v ``None``.

    ``window``: the layer's sliding window, told to the selector (:attr:`SelectorInputs.window`)
    so that it chooses only inside it; a plan whose selector does not declare
    ``Capabilities.sliding_window`` is refused on such a layer. The layer applies the window to
    the selection it hands a backend that does not apply windows itself
    (:func:`~kvsieve.sparse.window.window_params`; ``BackendCapabilities.window``), so every
    backend reads only the window."""

    def __init__(self, *, layer_idx: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 plan: LayerPlan | None = None, backend: AttentionBackend | str | None = None, kind: str = "gqa",
                 kv_lora_rank: int = 0, sm_scale: float | None = None, debug: bool = True,
                 device: str | torch.device = "cpu", window: int | None = None) -> None:
        if window is not None:
            check_value("SparseAttention.window", window, int, ge=1)
        self.layer_idx = layer_idx
        self.window = window
        self.geometry = AttentionGeometry(
            kind=kind, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            sm_scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim), kv_lora_rank=kv_lora_rank,
        )
        if backend is None:
            backend = default_backend(device)
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.plan = plan  # checked by the setter, with the backend
        self.debug = debug

    @property
    def plan(self) -> LayerPlan | None:
        """The layer's plan (``None`` = dense); setting one checks that its selector supports the
        layer's attention kind and window, and that the backend computes the layer's attention kind
        and what the selector asks of it (skip-softmax), before any step."""
        return self._plan

    @plan.setter
    def plan(self, plan: LayerPlan | None) -> None:
        try:
            if plan is not None:
                plan.selector.check_support(attention_kind=self.geometry.kind, window=self.window)
        except ValueError as e:
            raise ValueError(f"layer {self.layer_idx}: {e}") from None
        self.check_backend(plan)
        self._plan = plan
        self._attached: set[int] = set()  # live requests whose positions the plan's selector has seen
        self._seen_blocks: np.ndarray | None = None  # blocks whose per-block state the plan's selector built

    def check_backend(self, plan: LayerPlan | None, *, device: str | torch.device | None = None,
                      dtype: torch.dtype | None = None) -> None:
        """Raise ``ValueError`` naming the layer when the backend cannot compute this layer with
        ``plan`` (its attention kind, the skip-softmax its selector asks for) on ``device`` /
        ``dtype`` (``None``: not asked; the :class:`~kvsieve.sparse.Engine` asks with its cache's)."""
        reason = self.backend.refusal(attention_kind=self.geometry.kind, device=device, dtype=dtype,
                                      skip_softmax=plan is not None and plan.selector.capabilities.skip_softmax)
        if reason is not None:
            raise ValueError(f"layer {self.layer_idx}: {reason}")

    def record(self) -> SelectorRecord:
        """A copy of the layer's record of what its selector has seen (for :meth:`restore_record`)."""
        seen = None if self._seen_blocks is None else self._seen_blocks.copy()
        return SelectorRecord(frozenset(self._attached), seen)

    def restore_record(self, record: SelectorRecord) -> None:
        """Put back a record taken by :meth:`record` under the same plan (a step that failed is undone)."""
        self._attached = set(record.attached)
        self._seen_blocks = None if record.seen_blocks is None else record.seen_blocks.copy()

    def selector_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                        metadata: AttentionMetadata, model_inputs: object = None) -> SelectorInputs:
        """The hooks' inputs for this step (:func:`~kvsieve.sparse.selector_step.selector_inputs` with
        the layer's index, geometry, plan and window); ``model_inputs`` as given to :meth:`forward`."""
        return selector_inputs(q, k, v, metadata, layer_idx=self.layer_idx, geometry=self.geometry, plan=self.plan,
                               window=self.window, model_inputs=model_inputs)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                metadata: AttentionMetadata, *, model_inputs: object = None) -> LayerOutput:
        """One step of this layer. ``model_inputs``: the per-step model inputs the plan's selector
        declares (:attr:`SparseSelector.model_inputs_type`, e.g. DSA's ``IndexerInputs``), passed
        with every step and handed to the hooks as :attr:`SelectorInputs.model_inputs`; refused
        (before anything is written) when missing for such a selector or given to one that reads none."""
        if not metadata.prepared:
            raise RuntimeError("AttentionMetadata.prepare() must run before forward")
        metadata.require(f"backend {self.backend.name!r}", self.backend.required_translations)
        g = self.geometry
        if q.dim() != 3 or q.shape[0] != metadata.num_tokens or q.shape[1] != g.num_q_heads or q.shape[2] != g.head_dim:
            raise ValueError(f"layer {self.layer_idx}: q must be [num_tokens={metadata.num_tokens}, num_q_heads="
                             f"{g.num_q_heads}, head_dim={g.head_dim}], got {tuple(q.shape)}")
        check_model_inputs(self.layer_idx, self.plan, model_inputs)
        mgr = metadata.kv_cache_manager
        params = kept = inputs = None
        if self.plan is not None:
            inputs = self.selector_inputs(q, k, v, metadata, model_inputs)
            self._attach(inputs)
        slots = metadata.slots[metadata.token_to_req_host]
        mgr.write(self.layer_idx, slots, metadata.positions_host, k, v)
        if inputs is not None:
            selection = run_selector(self.plan, inputs, validate=self.debug)
            params, kept = selection.params, selection.kept
        attend = params
        if self.window is not None and not self.backend.capabilities.window:
            attend = window_params(params, metadata, g.num_kv_heads, self.window)
        res = self.backend.forward(q, metadata, self.layer_idx, g, attend)
        dense = metadata.token_kv_lens.to(torch.int64).sum() * g.num_kv_heads
        n_kept = self._compact(metadata, inputs, *kept) if kept is not None else None
        stats = LayerStats(int(res.attended.sum()), int(dense), n_kept, res.skipped_tiles, res.walked_tiles)
        return LayerOutput(res.out, res.lse, params, stats, dict(res.paths))

    def _attach(self, inputs: SelectorInputs) -> None:
        """``on_attach`` for the step's requests that hold earlier positions the plan's selector has
        not seen (it was installed after they began); refused, naming the request, for a selector
        that cannot rebuild its state."""
        md = inputs.metadata
        rids = md.request_ids  # the step's requests
        if not self._attached.issuperset(rids):
            self._attach_new(inputs)
        self._mark_seen(md)

    def _attach_new(self, inputs: SelectorInputs) -> None:
        md = inputs.metadata
        rids, mgr = md.request_ids, md.kv_cache_manager
        starts = md.cached_lens_host
        self._attached &= set(mgr.request_ids)
        p = mgr.tokens_per_block
        seen = self._seen_blocks if self._seen_blocks is not None else np.zeros(mgr.spec.num_blocks, dtype=bool)

        def shared_seen(i: int) -> bool:  # a beam or a reused prefix: blocks the selector already saw
            held = mgr.block_table[md.slots[i], : -(-int(starts[i]) // p)]
            return bool((seen[held] | seen[mgr.copied_from[held]]).all())

        unseen = np.array([i for i, rid in enumerate(rids) if starts[i] > 0 and rid not in self._attached
                           and not shared_seen(i)], dtype=np.int64)
        if len(unseen):
            why = attach_refusal(self.plan.selector)
            if why is not None:
                i = int(unseen[0])
                raise ValueError(f"layer {self.layer_idx}: request {rids[i]} holds {int(starts[i])} positions "
                                 f"from before the plan was installed; {why}")
            self.plan.selector.on_attach(inputs, unseen)
        self._attached.update(rids)

    def _mark_seen(self, md: AttentionMetadata) -> None:
        """Record the blocks this step's requests hold from their first new position on (every
        block of a context request, which an eviction may rewrite): the plan's selector has built
        their per-block state."""
        mgr = md.kv_cache_manager
        if self._seen_blocks is None:
            self._seen_blocks = np.zeros(mgr.spec.num_blocks, dtype=bool)
        p = mgr.tokens_per_block
        first = md.cached_lens_host // p
        first[: md.num_contexts] = 0
        for s, a, b in zip(md.slots, first, -(-md.kv_lens_host // p)):
            self._seen_blocks[mgr.block_table[s, a:b]] = True

    def _compact(self, metadata: AttentionMetadata, inputs: SelectorInputs, indices: torch.Tensor,
                 offsets: torch.Tensor) -> int:
        mgr = metadata.kv_cache_manager
        off = offsets.tolist()
        kept_per_req = []
        for i in range(metadata.num_contexts):
            rid = metadata.request_ids[i]
            sel = indices[:, off[i]: off[i + 1]]
            mgr.compact(self.layer_idx, rid, sel)
            kept_per_req.append(sel)
            prev = metadata.pending_kv_lens.setdefault(rid, sel.shape[1])
            if prev != sel.shape[1]:
                raise ValueError(f"request {rid}: layer {self.layer_idx} keeps {sel.shape[1]} tokens but an "
                                 f"earlier layer kept {prev}; all layers must keep the same number")
        self.plan.selector.on_compacted(inputs, kept_per_req)
        return sum(s.shape[1] for s in kept_per_req)


def commit_evictions(metadata: AttentionMetadata) -> dict[int, int]:
    """After every layer ran: truncate the ledger of each evicted request to its kept length."""
    done = dict(metadata.pending_kv_lens)
    for rid, n in done.items():
        metadata.kv_cache_manager.truncate(rid, n)
    metadata.pending_kv_lens.clear()
    return done
