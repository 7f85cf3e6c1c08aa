"""One layer step whose rows carry different per-request settings (:mod:`.request_settings`): the
selector runs once per group of requests with the same setting, each group as a sub-step of its
own requests, and the answers are joined into one carrier for the step.

The step's requests are ordered context first, then generation, and inside each phase by setting
(:meth:`.step.StepTranslator.prepare`), so each group is one contiguous slice of requests and of
query rows. Per group (:func:`select_by_setting`), on the group's own metadata over the same view
(:meth:`.step.StepTranslator.requests_metadata`) and its rows of q, k, v and model inputs:

1. the selector's hooks as kvsieve's layer runs them
   (:func:`~kvsieve.sparse.selector_step.run_selector`): ``on_append`` writes the group's own
   positions into the per-block state, which lives once per process (Quest's page summaries, DSA's
   index keys, in the view's auxiliary pools) and is shared by every setting: each request's blocks
   are written once, by its own group; then the predictions;
2. the selector is the process's own for default rows and, for a budget, the same selector class
   built with its budget knob set (:func:`with_setting`), which finds the same auxiliary pools; a
   ``dense`` group runs ``on_append`` only (its blocks stay in sync for whoever shares them);
3. the answers placed in the step's rows and joined (segments concatenated in row order, offsets
   added); rows of a dense group (or of a group whose selector answers dense) select every unit up
   to their length when other rows of their phase select, and stay dense otherwise.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from weakref import WeakKeyDictionary

import torch

from ...metadata import AttentionMetadata
from ...sparse import AttentionGeometry, LayerPlan, SparseRuntimeParams, SparseSelector
from ...sparse.selector_step import Selection, run_selector, selector_inputs
from .request_settings import RequestSetting

__all__ = ["select_by_setting", "with_setting", "plan_with_setting", "one_setting", "setting_groups",
           "RequestsMetadata"]

#: the metadata of a slice of a step's requests alone, over the same view
RequestsMetadata = Callable[[slice], AttentionMetadata]
#: budget variants kept per process selector (:func:`with_setting`)
MAX_VARIANTS = 16
_VARIANTS: WeakKeyDictionary[SparseSelector, OrderedDict[RequestSetting, SparseSelector]] = WeakKeyDictionary()


def with_setting(selector: SparseSelector, setting: RequestSetting) -> SparseSelector:
    """``selector``'s class built on its config with the budget knob set to ``setting.knob`` (the
    config's ``__post_init__`` checks it): the selector a process started with that budget would run.
    Built once per (process selector, setting) and shared by the layers (the last
    :data:`MAX_VARIANTS` settings kept). Per-block state lives in the cache's auxiliary pools, by
    name and at the blocks' ids (Quest's page summaries, DSA's index keys), where a new instance finds
    the same pools: it is never duplicated per setting. A selector served per request keeps its
    per-block state there, as every built-in does."""
    variants = _VARIANTS.setdefault(selector, OrderedDict())
    if setting not in variants:
        variants[setting] = type(selector)(dataclasses.replace(selector.config, **dict(setting.knob)))
        if len(variants) > MAX_VARIANTS:
            variants.popitem(last=False)
    variants.move_to_end(setting)
    return variants[setting]


def plan_with_setting(plan: LayerPlan, setting: RequestSetting | None) -> LayerPlan:
    """The plan a process started with ``setting`` as its default runs (``None``: ``plan`` itself):
    the same phases, the selector :func:`with_setting` builds."""
    return plan if setting is None else dataclasses.replace(plan, selector=with_setting(plan.selector, setting))


def one_setting(settings: tuple[RequestSetting | None, ...] | None) -> tuple[bool, RequestSetting | None]:
    """Whether a step's rows all carry one setting that a selector runs (not ``dense``), and which
    (``None``: the process default). ``settings``: the step's (:attr:`.step.VllmStep.settings`)."""
    if settings is None:
        return True, None
    first = settings[0]
    if first is None or first.dense or any(s != first for s in settings[1:]):
        return False, None
    return True, first


def setting_groups(settings: tuple[RequestSetting | None, ...], requests: slice) -> list[tuple[int, int]]:
    """Runs ``[r0, r1)`` of consecutive requests in ``requests`` with equal settings."""
    groups: list[tuple[int, int]] = []
    for r in range(requests.start, requests.stop):
        if groups and settings[r] == settings[groups[-1][0]]:
            groups[-1] = (groups[-1][0], r + 1)
        else:
            groups.append((r, r + 1))
    return groups


def select_by_setting(plan: LayerPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata,
                      settings: tuple[RequestSetting | None, ...], requests_metadata: RequestsMetadata, *,
                      layer_idx: int, geometry: AttentionGeometry, model_inputs: object = None) -> Selection:
    """The plan's selector on a step whose requests carry ``settings`` (one per request, in ``md``'s
    row order, ``None`` = the process default; module docstring): q ``[T, Hq, D]``, k/v ``[T, Hkv,
    D]`` (``md``'s order), ``requests_metadata(requests)`` the metadata of a slice of ``md``'s
    requests alone -> the step's :class:`~kvsieve.sparse.selector_step.Selection`, ``params`` over
    every query row (``sparse_attn_offsets [T + 1]``) or ``None`` when every row is dense."""
    qs = md.query_start_host
    parts: list[tuple[int, int, SparseRuntimeParams | None]] = []  # (first row, last row + 1, answer)
    kept = None
    for phase in md.phases():
        for r0, r1 in setting_groups(settings, md.phase_requests(phase)):
            rows, setting = slice(int(qs[r0]), int(qs[r1])), settings[r0]
            sub = requests_metadata(slice(r0, r1))
            inputs = selector_inputs(q[rows], k[rows], v[rows], sub, layer_idx=layer_idx, geometry=geometry,
                                     plan=plan, model_inputs=_rows_of(model_inputs, rows, md.num_tokens))
            if setting is not None and setting.dense:
                plan.selector.on_append(inputs)
                parts.append((rows.start, rows.stop, None))
                continue
            variant = plan_with_setting(plan, setting)
            selection = run_selector(variant, inputs)
            kept = kept or selection.kept
            answer = selection.params
            if answer is not None and any(answer.threshold_scale_factor(p) > 0 for p in ("context", "generation")):
                raise ValueError(f"selector {variant.selector.name!r} gives skip-softmax thresholds, which hold for "
                                 "a whole phase of a step and cannot differ per request")
            selects = answer is not None and answer.selects_positions(phase)
            parts.append((rows.start, rows.stop, _placed(answer, rows, md.num_tokens) if selects else None))
    params = _joined(parts, md.token_kv_lens, md.num_tokens, geometry.num_kv_heads, md.num_ctx_tokens)
    if params is not None:
        params.validate(num_kv_heads=geometry.num_kv_heads, num_query_tokens=md.num_tokens,
                        num_contexts=md.num_contexts, kv_lens=md.token_kv_lens)
    return Selection(params, kept)


def _rows_of(model_inputs: object, rows: slice, num_tokens: int) -> object:
    """``model_inputs`` (a dataclass of per-token tensors, e.g. DSA's ``IndexerInputs``) cut to
    ``rows``: every tensor field whose first dim is the step's ``num_tokens``."""
    if model_inputs is None:
        return None
    cut = {f.name: getattr(model_inputs, f.name)[rows] for f in dataclasses.fields(model_inputs)
           if isinstance(getattr(model_inputs, f.name), torch.Tensor)
           and getattr(model_inputs, f.name).shape[:1] == (num_tokens,)}
    return dataclasses.replace(model_inputs, **cut)


def _placed(params: SparseRuntimeParams, rows: slice, num_tokens: int) -> SparseRuntimeParams:
    """A group's carrier (offsets over its own rows) placed at ``rows`` of a step of ``num_tokens``."""
    off = params.sparse_attn_offsets.to(torch.int64)
    full = torch.cat([off.new_zeros(rows.start), off, off[-1:].expand(num_tokens - rows.stop)])
    return replace(params, sparse_attn_offsets=full)


def _joined(parts: list[tuple[int, int, SparseRuntimeParams | None]], token_kv_lens: torch.Tensor, num_tokens: int,
            num_kv_heads: int, num_ctx_tokens: int) -> SparseRuntimeParams | None:
    """The groups' answers (each over every row, its own rows' segments only) as one carrier:
    a phase selects when one of its groups does, and then its dense groups list every unit."""
    selecting = [p for _, _, p in parts if p is not None]
    if not selecting:
        return None
    block = {p.sparse_attn_indices_block_size for p in selecting}
    if len(block) != 1:
        raise ValueError(f"per-request settings gave selections in different units {sorted(block)} in one step")
    bs = block.pop()
    phases = {"context" if r0 < num_ctx_tokens else "generation" for r0, _, p in parts if p is not None}
    offsets = torch.zeros(num_tokens + 1, dtype=torch.int64, device=token_kv_lens.device)
    indices = []
    for r0, r1, p in parts:
        if p is None:
            if ("context" if r0 < num_ctx_tokens else "generation") not in phases:
                continue
            p = _every_unit(token_kv_lens, r0, r1, bs, num_kv_heads, num_tokens)
        offsets += p.sparse_attn_offsets.to(torch.int64)
        indices.append(p.sparse_attn_indices)
    return SparseRuntimeParams(sparse_attn_indices=torch.cat(indices, dim=1),
                               sparse_attn_offsets=offsets.to(torch.int32), sparse_attn_indices_block_size=bs,
                               selected_phases=frozenset(phases))


def _every_unit(token_kv_lens: torch.Tensor, r0: int, r1: int, block_size: int, num_kv_heads: int,
                num_tokens: int) -> SparseRuntimeParams:
    """Rows ``[r0, r1)`` selecting every unit of ``block_size`` positions up to their length
    (``token_kv_lens [num_tokens]``), every KV head alike: their dense attention as a selection."""
    units = (token_kv_lens[r0:r1].to(torch.int64) + block_size - 1) // block_size
    ends = torch.cumsum(units, 0)
    total = int(ends[-1]) if units.numel() else 0
    starts = torch.repeat_interleave(ends - units, units)
    idx = (torch.arange(total, device=units.device) - starts).to(torch.int32)
    offsets = torch.zeros(num_tokens + 1, dtype=torch.int64, device=units.device)
    offsets[r0 + 1: r1 + 1] = ends
    offsets[r1 + 1:] = total
    return SparseRuntimeParams(sparse_attn_indices=idx.expand(num_kv_heads, total).contiguous(),
                               sparse_attn_offsets=offsets, sparse_attn_indices_block_size=block_size)

