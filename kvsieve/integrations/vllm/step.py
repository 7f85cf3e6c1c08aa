"""The framework side of the plug-in, free of vLLM imports: translate one vLLM step into kvsieve's
:class:`~kvsieve.metadata.AttentionMetadata` over a :class:`~kvsieve.metadata.ForeignPagedKV`
view, and run one layer's selector and backend on it.

vLLM hands every attention layer of a step the same metadata object: ``query_start_loc [B+1]``,
``seq_lens [B]`` (tokens in the cache, this step's included), ``block_table [B, W]`` (physical
block ids) and ``num_actual_tokens``; prefill chunks and decode rows may be mixed in any order and
the step's K/V are already in the cache when attention runs. kvsieve wants context rows first.
A query token at a position before its request's prompt length is a *context* token (a prompt or a
chunk of one, attending its cached prefix and itself causally), every later one a *generation*
token: vLLM computes a request it preempted again as one prompt of its prompt and the tokens it
had generated, and those tokens are generation tokens, selected as their decode steps selected
them. So a vLLM row whose query crosses its prompt length is two kvsieve requests over the same
blocks, its prompt part (context) and its generated part (generation, several tokens). The prompt
lengths come from the per-request table (:func:`.request_settings.row_prompt_lens`); without them
(vLLM's dummy steps, which hold no request) a row with one query token is a generation row (vLLM's
own decode rule) and every other row a context row. The :class:`StepTranslator` splits and
reorders rows (and their tokens) context-first when needed, prepares the metadata once per step
(not per layer), and maps outputs back to vLLM's token order.

Dense context rows (every prompt row of a dense layer, of ``dense``, and of a plan that does not
select in the context phase) do not go through the kvsieve backend's general per-row gather: each
context request's K/V are gathered once, whole block by whole block, through the view, and torch
SDPA computes its causal attention in fp32 (:func:`dense_context_rows`). Every other row — all
selected rows, and the generation rows of the step — goes through the kvsieve backend (when the
context rows took the dense path, on a sub-step of the generation requests alone).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from ...metadata import AttentionMetadata
from ...metadata.foreign_paged import ForeignPagedKV
from ...sparse import AttentionBackend, AttentionGeometry, LayerPlan, SparseRuntimeParams, get_backend
from ...sparse.selector_step import check_model_inputs, run_selector, selector_inputs
from ...sparse.backends import AttentionResult, VanillaBackend, default_backend
from ...sparse.backends.sdpa import causal_sdpa
from ...sparse.params import is_dense
from .config import WorkerRanks
from .host import HostAttention, native_runs_attention, per_head_block_tables, token_runs
from .request_settings import RequestSetting, setting_ids
from .setting_groups import RequestsMetadata, one_setting, select_by_setting
from .state_check import StateCheck

__all__ = ["VllmStep", "StepTranslator", "LayerRunner", "SelectorFailed", "dense_context_rows"]


class SelectorFailed(RuntimeError):
    """A selector's hook raised inside a vLLM worker: names the selector, the layer, the worker and
    the exception (chained as ``__cause__``), so the engine ends with it rather than an anonymous
    traceback from inside the model's forward."""

_RUN_ROWS = 512  # query rows per runs call on a selecting prompt: its runs take rows x selected x Hkv entries


@dataclass(frozen=True)
class VllmStep:
    """What kvsieve reads of vLLM's step metadata, on the host: ``query_start_loc [B+1]``,
    ``seq_lens [B]``, ``block_table [B, W]`` (int32 numpy) and ``num_tokens`` (= the last query start);
    ``settings``: each row's per-request setting (:mod:`.request_settings`; ``None`` entries the
    process default), or ``None`` when every row uses the process default; ``prompt_lens``: int32
    ``[B]``, each row's request's prompt length, or ``None`` when not known (module docstring)."""

    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray
    settings: tuple[RequestSetting | None, ...] | None = None
    prompt_lens: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @cached_property
    def context_tokens(self) -> np.ndarray:
        """int64 ``[B]``: how many of each row's query tokens (its first ones) are prompt tokens."""
        q_lens = np.diff(self.query_start_loc).astype(np.int64)
        if self.prompt_lens is None:
            return np.where(q_lens == 1, 0, q_lens)
        first = self.seq_lens.astype(np.int64) - q_lens  # each row's first query position
        return np.clip(self.prompt_lens.astype(np.int64) - first, 0, q_lens)

    @cached_property
    def decode_only(self) -> bool:
        """Whether every row is one request's one new generated token (computed once per step)."""
        return bool((np.diff(self.query_start_loc) == 1).all()) and not self.context_tokens.any()

    @cached_property
    def one_setting(self) -> tuple[bool, RequestSetting | None]:
        """Whether every row carries one setting a selector runs, and which (computed once per step;
        :func:`.setting_groups.one_setting`)."""
        return one_setting(self.settings)

    @cached_property
    def positions(self) -> torch.Tensor:
        """int64 ``[B]``: each row's last position, ``seq_lens - 1`` (a decode row's new token)."""
        return torch.from_numpy(self.seq_lens.astype(np.int64) - 1)

    def same_as(self, other: VllmStep) -> bool:
        if self.settings != other.settings or (self.prompt_lens is None) != (other.prompt_lens is None):
            return False
        mine = (self.query_start_loc, self.seq_lens, self.block_table, self.prompt_lens)
        theirs = (other.query_start_loc, other.seq_lens, other.block_table, other.prompt_lens)
        return all(a is None or np.array_equal(a, b) for a, b in zip(mine, theirs))

    @classmethod
    def from_tensors(cls, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                     num_actual_tokens: int, settings: tuple[RequestSetting | None, ...] | None = None,
                     prompt_lens: np.ndarray | None = None) -> VllmStep:
        b = seq_lens.shape[0]
        qsl = query_start_loc[: b + 1].cpu().numpy().astype(np.int32)
        step = cls(qsl, seq_lens.cpu().numpy().astype(np.int32), block_table[:b].cpu().numpy().astype(np.int32),
                   settings, prompt_lens)
        if step.num_tokens != num_actual_tokens:
            raise ValueError(f"vLLM step: query_start_loc ends at {step.num_tokens} but num_actual_tokens="
                             f"{num_actual_tokens}")
        if bool((step.seq_lens < np.diff(qsl)).any()):
            raise ValueError("vLLM step: a request has fewer cached tokens (seq_lens) than query tokens")
        if prompt_lens is not None and prompt_lens.shape != (b,):
            raise ValueError(f"vLLM step: {prompt_lens.shape[0]} prompt lengths for {b} rows")
        return step


class StepTranslator:
    """One per process and KV-cache group: the view, the metadata, and the step it was prepared for."""

    def __init__(self, view: ForeignPagedKV, *, max_num_tokens: int, translations: tuple[str, ...]) -> None:
        self.view = view
        self.metadata = AttentionMetadata(kv_cache_manager=view, max_num_requests=view.spec.max_requests,
                                          max_num_tokens=max_num_tokens, translations=translations)
        self._step: VllmStep | None = None
        self._parts: dict[tuple[int, int], AttentionMetadata] = {}  # slices of the step's requests, on demand
        self._spare: list[AttentionMetadata] = []  # metadata objects of earlier steps' slices, reused
        self.token_order: torch.Tensor | None = None  # kvsieve row t is vLLM token token_order[t]; None = same
        self.row_settings: tuple[RequestSetting | None, ...] | None = None  # per request row, kvsieve order

    def prepare(self, step: VllmStep) -> AttentionMetadata:
        """Prepare the metadata for ``step``; the layers after the first of a step find it prepared
        (the metadata is a function of the step's tables, so equal tables reuse it). A row whose query
        crosses its prompt length becomes two requests (module docstring). Requests are ordered
        context first, then generation, and inside a phase by per-request setting (the default
        first), so each setting's rows are one slice (:mod:`.setting_groups`)."""
        if self._step is step or (self._step is not None and self._step.same_as(step)):
            return self.metadata
        qsl = step.query_start_loc.astype(np.int64)
        ctx = step.context_tokens
        gen = np.diff(qsl) - ctx
        ctx_rows, gen_rows = np.flatnonzero(ctx > 0), np.flatnonzero(gen > 0)
        if step.settings is not None:  # inside a phase by setting, then by row
            ids = setting_ids(step.settings)
            ctx_rows = ctx_rows[np.lexsort((ctx_rows, ids[ctx_rows]))]
            gen_rows = gen_rows[np.lexsort((gen_rows, ids[gen_rows]))]
        # the vLLM row of each kvsieve request; a row's prompt part comes before its generated part, so a
        # page both touch is summarized last over the longer prefix (a selector's on_append writes in order)
        rows = np.concatenate([ctx_rows, gen_rows])
        starts = np.concatenate([qsl[ctx_rows], qsl[gen_rows] + ctx[gen_rows]])  # its first query token
        counts = np.concatenate([ctx[ctx_rows], gen[gen_rows]])
        kv_lens = np.concatenate([step.seq_lens[ctx_rows] - gen[ctx_rows], step.seq_lens[gen_rows]])
        tok = np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
        self.token_order = None if np.array_equal(tok, np.arange(tok.size)) else torch.from_numpy(tok)
        self.row_settings = None if step.settings is None else tuple(step.settings[i] for i in rows)
        self.view.set_batch(step.block_table[rows], kv_lens.astype(np.int32))
        md = self.metadata
        md.request_ids = list(range(rows.size))
        md.seq_lens = torch.from_numpy(counts.astype(np.int32))
        md.num_contexts = int(ctx_rows.size)
        md.prepare()
        self._step = step
        self._spare.extend(self._parts.values())
        self._parts.clear()
        return md

    def generation_metadata(self) -> AttentionMetadata:
        """The prepared step's generation requests alone (rows ``[0, num_generation_tokens)`` = the
        step's :attr:`~AttentionMetadata.generation_rows`; :meth:`requests_metadata`)."""
        return self.requests_metadata(self.metadata.phase_requests("generation"))

    def requests_metadata(self, requests: slice) -> AttentionMetadata:
        """The prepared step's requests ``requests`` (a slice of its rows) alone, as their own metadata
        over the same view; prepared once per step and slice, on first use."""
        key = (requests.start, requests.stop)
        if key not in self._parts:
            md = self.metadata
            part = self._spare.pop() if self._spare else AttentionMetadata(
                kv_cache_manager=self.view, max_num_requests=md.max_num_requests, max_num_tokens=md.max_num_tokens,
                translations=md.translations)
            part.request_ids = md.request_ids[requests]
            part.seq_lens = md.seq_lens[requests]
            part.num_contexts = max(0, min(md.num_contexts, requests.stop) - requests.start)
            part.prepare()
            self._parts[key] = part
        return self._parts[key]

    def to_kvsieve(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of a ``[num_tokens, ...]`` tensor in kvsieve's (context-first) order."""
        return x if self.token_order is None else x[self.token_order.to(x.device)]

    def to_vllm(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Write kvsieve-ordered rows ``x`` into ``out`` in vLLM's token order."""
        if self.token_order is None:
            out.copy_(x)
        else:
            out[self.token_order.to(out.device)] = x


class LayerRunner:
    """One attention layer: the selector (if the layer has a plan), then the attention — prompt
    rows the layer does not select through :func:`dense_context_rows`, the others through the
    kvsieve backend.

    ``capture_dir``: also run the Vanilla golden on the same selection and append one JSON line
    per call (layer, tokens, contexts, attended and dense positions, largest difference to the
    golden, and to the host engine's own attention output when the caller passes it; the
    worker's ``ranks`` and the layer's head counts on this worker). ``state_check``: after the
    selector's hooks, compare its per-block state with a recomputation (:mod:`.state_check`)."""

    def __init__(self, *, layer_idx: int, geometry: AttentionGeometry, plan: LayerPlan | None,
                 backend: AttentionBackend, capture_dir: Path | None = None,
                 ranks: WorkerRanks = WorkerRanks(), state_check: StateCheck | None = None) -> None:
        self.layer_idx, self.geometry, self.plan, self.backend = layer_idx, geometry, plan, backend
        self.capture_dir, self.ranks, self.state_check = capture_dir, ranks, state_check
        self.golden = VanillaBackend() if capture_dir is not None else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepTranslator,
                host: HostAttention | None = None, *, model_inputs: object = None) -> AttentionResult:
        """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` (kvsieve order, already in the cache), ``step`` the
        translator holding the step's prepared metadata, ``model_inputs`` what the selector reads per
        step (:class:`~kvsieve.selectors.dsa.IndexerInputs`, kvsieve order) -> an
        :class:`~kvsieve.sparse.backends.AttentionResult` (``out [T, Hq, D]``, ``attended [T, Hkv]``, ...).
        The selector is asked only about the rows of its plan's phases present this step, exactly as
        :meth:`SparseAttention.forward` asks it (same inputs, same placement of its answer). Dense
        context rows take :func:`dense_context_rows` (``lse`` is then ``None``, as on kvsieve's SDPA
        path); the other rows the kvsieve backend.

        With ``host`` (the host engine's own kernels, :mod:`.host`): a step the layer attends densely
        in every phase present is the host's own attention (path ``host_dense``); generation rows
        whose selection is whole cache blocks go to the host's paged kernel with per-(row, KV head)
        block tables (``host_paged``), any other position selection of generation rows to kvsieve's
        native decode kernel on per-(row, KV head) runs read in place (``native_runs``), their step's
        context rows (dense) to the host's own attention. Every other case (a selecting prompt row,
        skip-softmax, a cache or shape the native kernel does not take) as without ``host``; the capture also compares dense layer
        calls with the host's own attention."""
        md = step.metadata
        params = self.select(q, k, v, md, model_inputs, settings=step.row_settings,
                             requests_metadata=step.requests_metadata)
        res = None if host is None else self._on_host(q, step, params, host)
        if res is None and "context" in md.phases() and is_dense(params, "context"):
            res = self._dense_context_first(q, step, params)
        elif res is None:
            res = self.backend.forward(q, md, self.layer_idx, self.geometry, params)
        if self.golden is not None:
            self._capture(q, md, params, res, None if host is None else step.to_kvsieve(host.dense()))
        return res

    def _on_host(self, q: torch.Tensor, step: StepTranslator, params: SparseRuntimeParams | None,
                 host: HostAttention) -> AttentionResult | None:
        """The step on the host's kernels (:meth:`forward`), or ``None`` when they cannot compute it."""
        md, g = step.metadata, self.geometry
        phases = md.phases()
        if any(params is not None and params.threshold_scale_factor(p) > 0 for p in phases):
            return None
        if all(is_dense(params, p) for p in phases):
            attended = md.token_kv_lens.to(torch.int64)[:, None].expand(-1, g.num_kv_heads)
            return AttentionResult(step.to_kvsieve(host.dense()), None, attended, dict.fromkeys(phases, "host_dense"))
        if "context" in phases and params.selects_positions("context"):
            return self._positions_on_host(q, step, params, host)
        if "generation" not in phases:
            return None
        hkv, rows = g.num_kv_heads, md.generation_rows
        if "context" not in phases:  # a decode-only step: every row is a generation row
            gen = self._generation_on_host(q, step, params, host)
            return None if gen is None else AttentionResult(gen[0], None, gen[1], {"generation": gen[2]})
        # a mixed step: the context rows (dense) from the host's own attention of the whole step, copied
        # (host.dense() stays the host's own output: the capture compares with it)
        out = step.to_kvsieve(host.dense()).clone()
        attended = md.token_kv_lens.to(torch.int64)[:, None].repeat(1, hkv)
        gen = self._generation_on_host(q[rows], step, params, host)
        if gen is None:  # not a selection the host path reads: the backend on the decode rows' sub-step
            sub = self.backend.forward(q[rows], step.generation_metadata(), self.layer_idx, g,
                                       _rows_params(params, rows))
            out[rows], attended[rows], path = sub.out, sub.attended, sub.paths["generation"]
        else:
            out[rows], attended[rows], path = gen
        return AttentionResult(out, None, attended, {"context": "host_dense", "generation": path})

    def _positions_on_host(self, q: torch.Tensor, step: StepTranslator, params: SparseRuntimeParams,
                           host: HostAttention) -> AttentionResult | None:
        """A step whose every phase present selects positions (a prompt under DSA): the prompt rows,
        each with its causal length, through kvsieve's native kernel on runs of the host's cache read in
        place (:func:`.host.token_runs`, ``_RUN_ROWS`` rows per call to bound the runs' size), the
        generation rows as :meth:`_generation_on_host` takes them; ``None`` where a phase is dense or the
        kernels do not take the cache."""
        md, g = step.metadata, self.geometry
        if not all(params.selects_positions(p) for p in md.phases()):
            return None
        out = q.new_empty(md.num_tokens, g.num_q_heads, g.value_dim)
        attended = torch.empty(md.num_tokens, g.num_kv_heads, dtype=torch.int64)
        rows = md.context_rows
        for r0 in range(rows.start, rows.stop, _RUN_ROWS):
            chunk = slice(r0, min(r0 + _RUN_ROWS, rows.stop))
            runs = token_runs(params, md, step.view, chunk)
            part = native_runs_attention(q[chunk], runs, step.view, self.layer_idx, g)
            if part is None:
                return None
            out[chunk], attended[chunk] = part, torch.from_numpy(runs.attended)
        paths = {"context": "native_runs"}
        if "generation" in md.phases():
            gen = md.generation_rows
            done = self._generation_on_host(q[gen], step, params, host)
            if done is None:
                return None
            out[gen], attended[gen], paths["generation"] = done
        return AttentionResult(out, None, attended, paths)

    def _generation_on_host(self, q: torch.Tensor, step: StepTranslator, params: SparseRuntimeParams,
                            host: HostAttention) -> tuple[torch.Tensor, torch.Tensor, str] | None:
        """The generation rows' selected attention without the kvsieve backend: q ``[N, Hq, D]`` (those
        rows) -> ``(out [N, Hq, D], attended [N, Hkv] int64, path)``. A selection of whole cache blocks
        in which every (row, KV head) selects some: the host's paged kernel on per-head block tables
        (``host_paged``); any other position selection: kvsieve's native kernel on per-(row, KV head)
        runs read in place from the view (``native_runs``); ``None`` where neither takes it."""
        md, g = step.metadata, self.geometry
        hkv = g.num_kv_heads
        tables = per_head_block_tables(params, md, step.view)
        if tables is not None:
            paged = host.paged_per_head(q.reshape(-1, g.num_q_heads // hkv, g.head_dim), tables)
            return paged.view(-1, g.num_q_heads, g.value_dim), tables.seq_lens.view(-1, hkv).to(torch.int64), "host_paged"
        runs = token_runs(params, md, step.view)
        out = None if runs is None else native_runs_attention(q, runs, step.view, self.layer_idx, g)
        return None if out is None else (out, torch.from_numpy(runs.attended), "native_runs")

    def select(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata,
               model_inputs: object = None, *, settings: tuple[RequestSetting | None, ...] | None = None,
               requests_metadata: RequestsMetadata | None = None) -> SparseRuntimeParams | None:
        """The plan's selector on this step (:func:`~kvsieve.sparse.selector_step.run_selector`, the
        steps kvsieve's own layer runs after its K/V write; vLLM wrote the K/V) -> its validated answer
        placed in the step's rows, ``None`` = dense. ``model_inputs``: what the selector declares it
        reads per step (checked as kvsieve's layer checks them); ``settings``: each request row's
        per-request setting (:meth:`StepTranslator.prepare`'s order), the selector then running per
        group of requests on ``requests_metadata`` (:func:`.setting_groups.select_by_setting`). A
        selector that evicts is refused; one whose hooks raise is :class:`SelectorFailed`."""
        check_model_inputs(self.layer_idx, self.plan, model_inputs)
        if self.plan is None:
            return None
        inputs = selector_inputs(q, k, v, md, layer_idx=self.layer_idx, geometry=self.geometry, plan=self.plan,
                                 model_inputs=model_inputs)
        try:
            if settings is None:
                selection = run_selector(self.plan, inputs)
            else:
                selection = select_by_setting(self.plan, q, k, v, md, settings, requests_metadata,
                                              layer_idx=self.layer_idx, geometry=self.geometry,
                                              model_inputs=model_inputs)
        except Exception as e:
            r = self.ranks
            raise SelectorFailed(
                f"kvsieve vLLM plug-in: selector {self.plan.selector.name!r} raised in layer {self.layer_idx} (worker "
                f"tensor-parallel rank {r.tp_rank} of {r.tp_size}, pipeline stage {r.pp_rank} of {r.pp_size}): "
                f"{type(e).__name__}: {e}") from e
        if self.state_check is not None:  # the pools are shared by every setting's selector: checked once
            self.state_check.check(self.plan.selector, inputs)
        if selection.kept is not None:
            raise _eviction_refused(self.plan.selector.name, "predict_kv")
        if selection.params is not None and selection.params.sparse_kv_indices is not None:
            raise _eviction_refused(self.plan.selector.name, "sparse_kv_indices from predict_attn")
        return selection.params

    def _dense_context_first(self, q: torch.Tensor, step: StepTranslator, params: SparseRuntimeParams | None
                             ) -> AttentionResult:
        """Context rows through :func:`dense_context_rows`; generation rows (if any) through the
        backend on :meth:`StepTranslator.generation_metadata` with ``params`` cut to their rows."""
        md, g = step.metadata, self.geometry
        out = q.new_empty(md.num_tokens, g.num_q_heads, g.value_dim)
        out[md.context_rows] = dense_context_rows(q, md, self.layer_idx, g)
        paths, skipped, walked = {"context": "sdpa_dense"}, 0, 0
        if "generation" in md.phases():
            rows = md.generation_rows
            sub = self.backend.forward(q[rows], step.generation_metadata(), self.layer_idx, g,
                                       _rows_params(params, rows))
            out[rows] = sub.out
            paths["generation"], skipped, walked = sub.paths["generation"], sub.skipped_tiles, sub.walked_tiles
        return AttentionResult(out, None, self.backend.effective_attended_tokens(params, md, g), paths, skipped, walked)

    def _capture(self, q: torch.Tensor, md: AttentionMetadata, params: SparseRuntimeParams | None,
                 res: AttentionResult, host_output: torch.Tensor | None) -> None:
        ref, out = self.golden.forward(q, md, self.layer_idx, self.geometry, params).out, res.out
        attended = self.golden.effective_attended_tokens(params, md, self.geometry)
        record = {
            "layer": self.layer_idx, "num_tokens": md.num_tokens, "num_contexts": md.num_contexts,
            "tp_rank": self.ranks.tp_rank, "pp_rank": self.ranks.pp_rank,
            "num_q_heads": self.geometry.num_q_heads, "num_kv_heads": self.geometry.num_kv_heads,
            "selector": None if self.plan is None else self.plan.selector.name,
            "sparse": params is not None and params.sparse_attn_indices is not None,
            "attended": int(attended.sum()), "dense": int(md.token_kv_lens.to(torch.int64).sum()) * self.geometry.num_kv_heads,
            "max_abs_diff": float((out.float() - ref.float()).abs().max()) if out.numel() else 0.0,
            "ref_max_abs": float(ref.float().abs().max()) if ref.numel() else 0.0, "dtype": str(q.dtype),
            "paths": res.paths,
            "host_max_abs_diff": None if host_output is None or params is not None or not out.numel()
            else float((out.float() - host_output.float()).abs().max()),
        }
        self.capture_dir.mkdir(parents=True, exist_ok=True)
        with open(self.capture_dir / f"capture-{os.getpid()}.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def _eviction_refused(selector: str, where: str) -> ValueError:
    # lower_plans refuses selectors declaring evicts=True; this one evicts without declaring it
    return ValueError(f"kvsieve vLLM plug-in: selector {selector!r} returned prompt tokens to keep ({where}); "
                      "vLLM's block manager owns the blocks and lengths, so eviction is refused")


def _rows_params(params: SparseRuntimeParams | None, rows: slice) -> SparseRuntimeParams | None:
    """``params`` of a step cut to the query rows ``rows`` (their segments, offsets from 0); no
    prompt-eviction fields (the plug-in refuses them)."""
    if params is None or params.sparse_attn_indices is None:
        return params
    return params.row_slice(rows)


def dense_context_rows(q: torch.Tensor, md: AttentionMetadata, layer_idx: int, geometry: AttentionGeometry
                       ) -> torch.Tensor:
    """Dense causal attention of the step's context rows: q ``[T, Hq, D]`` (kvsieve order) ->
    ``[num_ctx_tokens, Hq, Dv]`` in q's dtype. Per context request its K/V ``[Hkv, kv_len, D]``
    are gathered through the view whole block by whole block (one ``index_select`` of its
    physical blocks each) and torch SDPA computes the bottom-right causal attention in fp32."""
    view = md.kv_cache_manager
    k_cache, v_cache = view.k_cache(layer_idx), view.v_cache(layer_idx)
    out = q.new_empty(md.num_ctx_tokens, q.shape[1], geometry.value_dim)
    starts, kv_lens = md.query_start_host, md.kv_lens_host
    for i in range(md.num_contexts):
        slot, t0, t1 = int(md.slots[i]), int(starts[i]), int(starts[i + 1])
        ids = torch.from_numpy(view.block_table[slot, : int(view.num_blocks_of[slot])].astype(np.int64)).to(q.device)
        k, v = (_request_kv(c, ids, int(kv_lens[i])) for c in (k_cache, v_cache))
        out[t0:t1] = causal_sdpa(q[t0:t1].float(), k, v, geometry.sm_scale).to(q.dtype)
    return out


def _request_kv(cache: torch.Tensor, block_ids: torch.Tensor, kv_len: int) -> torch.Tensor:
    """``cache [num_blocks, Hkv, P, D]`` (any strides) at ``block_ids`` -> fp32 ``[Hkv, kv_len, D]``."""
    sel = cache.index_select(0, block_ids)
    return sel.transpose(0, 1).reshape(sel.shape[1], -1, sel.shape[-1])[:, :kv_len].float()


def make_backend(name: str | None, device: torch.device) -> AttentionBackend:
    """The kvsieve backend by name (``None``: ``torch`` on CPU, ``triton`` on CUDA). Backends do not
    declare devices: one that cannot run on ``device`` refuses at its first step, naming what it
    needs (``triton`` on CPU without ``TRITON_INTERPRET=1``, ``cute`` off CUDA)."""
    return get_backend(name or default_backend(device))
