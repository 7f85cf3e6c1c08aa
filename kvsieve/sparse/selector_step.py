"""The layer's selector steps, written once: what every caller of a selector runs on one layer step.

Both kvsieve's own layer (:class:`~kvsieve.sparse.SparseAttention`, which writes the step's K/V
itself) and a host engine's attention path (the vLLM plug-in, where the engine already wrote them)
run the same sequence on the step's :class:`SelectorInputs`:

1. :func:`check_model_inputs`: the per-step model inputs the selector declares
   (:attr:`SparseSelector.model_inputs_type`) are present and of that type, and none are given to
   a layer whose selector reads none (before anything is written);
2. :func:`selector_inputs`: the hooks' inputs — the plan's phases present this step and their rows;
3. :func:`run_selector`, after the step's K/V are in the cache: ``on_append`` ->
   ``predict_kv`` (context phase asked) -> ``predict_attn`` (any phase asked) -> the answer placed
   in the step's rows (:func:`place_rows`) with the kept prompt tokens -> ``validate``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..metadata import AttentionMetadata
from .backends import AttentionGeometry
from .config import LayerPlan
from .params import PHASES, SparseRuntimeParams
from .selector_base import SelectorInputs

__all__ = ["Selection", "check_model_inputs", "selector_inputs", "run_selector", "place_rows"]


@dataclass(frozen=True)
class Selection:
    """What a layer's selector decided for one step.

    ``params``: the :class:`SparseRuntimeParams` placed in the step's rows (``sparse_attn_offsets
    [num_tokens + 1]``), with the kept prompt tokens in ``sparse_kv_indices`` /
    ``sparse_kv_offsets`` when the selector evicts; ``None`` = dense. ``kept``: ``predict_kv``'s
    answer, ``(sparse_kv_indices [Hkv, total_kept] int32, sparse_kv_offsets [num_contexts + 1]
    int32)``, or ``None`` (nothing evicted)."""

    params: SparseRuntimeParams | None
    kept: tuple[torch.Tensor, torch.Tensor] | None


def check_model_inputs(layer_idx: int, plan: LayerPlan | None, model_inputs: object) -> None:
    """Refuse (``ValueError`` naming the layer and selector) model inputs the plan's selector does not
    declare, and a missing or mistyped one it needs."""
    sel = plan.selector if plan is not None else None
    wanted = sel.model_inputs_type if sel is not None else None
    if wanted is None:
        if model_inputs is not None:
            who = "the layer is dense" if sel is None else f"selector {sel.name!r} reads none"
            raise ValueError(f"layer {layer_idx}: model_inputs ({type(model_inputs).__name__}) were given "
                             f"but {who}")
    elif not isinstance(model_inputs, wanted):
        got = "none" if model_inputs is None else type(model_inputs).__name__
        raise ValueError(f"layer {layer_idx}: selector {sel.name!r} needs this step's {wanted.__name__} "
                         f"(SparseAttention.forward(..., model_inputs=...), every step), got {got}")


def selector_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, metadata: AttentionMetadata, *,
                    layer_idx: int, geometry: AttentionGeometry, plan: LayerPlan | None,
                    window: int | None = None, model_inputs: object = None) -> SelectorInputs:
    """The hooks' inputs for one layer step: ``phases`` = the plan's phases present this step (none
    without a plan, and none in a step the engine runs densely, :attr:`AttentionMetadata.dense`:
    ``on_append`` still runs, nothing is chosen), ``rows`` their query rows (context rows first, so
    one contiguous slice). q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` (MLA: k the latent ``[T, R + rope]``,
    v ``None``)."""
    plan_phases = plan.phases if plan is not None and not metadata.dense else frozenset()
    phases = tuple(p for p in metadata.phases() if p in plan_phases)
    rows = slice(metadata.phase_rows(phases[0]).start, metadata.phase_rows(phases[-1]).stop) if phases \
        else slice(0, 0)
    g = geometry
    return SelectorInputs(q=q, k=k, v=v, metadata=metadata, layer_idx=layer_idx, num_kv_heads=g.num_kv_heads,
                          sm_scale=g.sm_scale, attention_kind=g.kind, rows=rows, phases=frozenset(phases),
                          model_inputs=model_inputs, window=window)


def run_selector(plan: LayerPlan, inputs: SelectorInputs, *, validate: bool = True) -> Selection:
    """The selector hooks of one layer step, the step's K/V already in the cache: ``on_append``,
    ``predict_kv`` when the context phase is asked, ``predict_attn`` when any phase is, the answer
    placed in the step's rows, the kept prompt tokens added, and (``validate``) every carrier rule
    checked (:meth:`SparseRuntimeParams.validate`, naming the field)."""
    sel = plan.selector
    md = inputs.metadata
    sel.on_append(inputs)
    kept = params = None
    if "context" in inputs.phases:
        kept = _checked_kept(sel.name, sel.predict_kv(inputs))
    if inputs.phases:
        params = place_rows(_checked_params(sel.name, sel.predict_attn(inputs)), inputs, sel.name)
    if kept is not None:
        base = params if params is not None else SparseRuntimeParams()
        params = replace(base, sparse_kv_indices=kept[0], sparse_kv_offsets=kept[1])
    if params is not None and validate:
        prompt_lens = torch.as_tensor(md.kv_lens_host[: md.num_contexts])
        params.validate(num_kv_heads=inputs.num_kv_heads, num_query_tokens=md.num_tokens,
                        num_contexts=md.num_contexts, kv_lens=md.token_kv_lens, prompt_lens=prompt_lens)
    return Selection(params, kept)


def place_rows(params: SparseRuntimeParams | None, inputs: SelectorInputs, selector: str
               ) -> SparseRuntimeParams | None:
    """A selector's answer for ``inputs.rows`` placed in the step's rows: the offsets grow to
    ``num_tokens + 1`` (rows outside get empty segments), ``selected_phases`` is narrowed to the
    phases asked, and the skip-softmax factor of a phase not asked is 0."""
    if params is None:
        return None
    md, rows = inputs.metadata, inputs.rows
    fields: dict[str, object] = {f"threshold_scale_factor_{p}": 0.0 for p in PHASES
                                 if p not in inputs.phases and params.threshold_scale_factor(p) != 0.0}
    if params.sparse_attn_indices is not None:
        off = params.sparse_attn_offsets
        if off is None or off.dim() != 1 or off.numel() != inputs.num_rows + 1:
            got = None if off is None else tuple(off.shape)
            raise ValueError(f"selector {selector!r}: predict_attn was asked about rows [{rows.start}, {rows.stop}) "
                             f"({inputs.num_rows} rows) and must return sparse_attn_offsets with "
                             f"{inputs.num_rows + 1} entries, got shape {got}")
        if inputs.num_rows != md.num_tokens:
            end = off[-1:]
            fields["sparse_attn_offsets"] = torch.cat([off.new_zeros(rows.start), off,
                                                       end.expand(md.num_tokens - rows.stop)])
        phases = params.selected_phases & inputs.phases
        if not phases:  # the selector selects in none of the phases it was asked about: dense rows
            fields.update(sparse_attn_indices=None, sparse_attn_offsets=None, selected_phases=frozenset(PHASES))
        elif phases != params.selected_phases:
            fields["selected_phases"] = phases
    return replace(params, **fields) if fields else params  # a carrier already in place is returned as is


def _checked_params(selector: str, params: object) -> SparseRuntimeParams | None:
    if params is not None and not isinstance(params, SparseRuntimeParams):
        raise TypeError(f"selector {selector!r}: predict_attn must return SparseRuntimeParams or None, "
                        f"got {type(params).__name__}")
    return params


def _checked_kept(selector: str, kept: object) -> tuple[torch.Tensor, torch.Tensor] | None:
    if kept is None:
        return None
    if not (isinstance(kept, tuple) and len(kept) == 2 and all(isinstance(t, torch.Tensor) for t in kept)):
        raise TypeError(f"selector {selector!r}: predict_kv must return (sparse_kv_indices, sparse_kv_offsets) "
                        f"tensors or None, got {type(kept).__name__}")
    return kept
