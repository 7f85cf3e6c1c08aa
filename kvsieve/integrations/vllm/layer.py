"""The per-layer half of the plug-in, free of vLLM imports: one layer call on a prepared step
(:class:`~.step.PreparedStep`) — the layer's selector, then each phase's rows on the path
:func:`.router.route_rows` names (the host's kernels, kvsieve's native runs kernel, SDPA on a
gather for dense prompt rows, or the kvsieve backend).

Dense context rows without the host's kernels (every prompt row of a dense layer, of ``dense``, and
of a plan that does not select in the context phase, on CUDA) do not go through the kvsieve
backend's general per-row gather: each context request's K/V are gathered once, whole block by
whole block, through the view, and torch SDPA computes its causal attention in fp32
(:func:`dense_context_rows`); the step's generation rows then take the backend on a sub-step of
the generation requests alone.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ...metadata import AttentionMetadata
from ...sparse import AttentionBackend, AttentionGeometry, LayerPlan, SparseRuntimeParams, get_backend
from ...sparse.backends import AttentionResult, default_backend
from ...sparse.backends.sdpa import causal_sdpa
from ...sparse.selector_step import check_model_inputs, run_selector, selector_inputs
from .config import WorkerRanks
from .golden_capture import GoldenCapture
from .host import HostAttention, causal_attention, native_runs_attention, runs_kernel_takes, token_runs, verify_pass
from .request_settings import RequestSetting
from .router import (BACKEND, CAUSAL_ROWS, HOST_DENSE, HOST_PAGED, NATIVE_RUNS, SDPA_DENSE, RowsRoute,
                     route_rows)
from .setting_groups import RequestsMetadata, select_by_setting
from .state_check import StateCheck
from .step import PreparedStep

__all__ = ["LayerRunner", "SelectorFailed", "dense_context_rows", "make_backend"]


class SelectorFailed(RuntimeError):
    """A selector's hook raised inside a vLLM worker: names the selector, the layer, the worker and
    the exception (chained as ``__cause__``), so the engine ends with it rather than an anonymous
    traceback from inside the model's forward."""


_RUN_ROWS = 512  # query rows per runs call on a selecting prompt: its runs take rows x selected x Hkv entries


class LayerRunner:
    """One attention layer: the selector (if the layer has a plan), then the attention, each phase's
    rows on the path :func:`.router.route_rows` names. ``capture_dir``: also run the Vanilla golden
    and record the call (:mod:`.golden_capture`); ``state_check``: after the selector's hooks, compare
    its per-block state with a recomputation (:mod:`.state_check`)."""

    def __init__(self, *, layer_idx: int, geometry: AttentionGeometry, plan: LayerPlan | None,
                 backend: AttentionBackend, capture_dir: Path | None = None,
                 ranks: WorkerRanks = WorkerRanks(), state_check: StateCheck | None = None) -> None:
        self.layer_idx, self.geometry, self.plan, self.backend = layer_idx, geometry, plan, backend
        self.ranks, self.state_check = ranks, state_check
        self.capture = None if capture_dir is None else GoldenCapture(capture_dir, ranks)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: PreparedStep,
                host: HostAttention | None = None, *, model_inputs: object = None) -> AttentionResult:
        """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` (kvsieve order, already in the cache), ``step`` the
        prepared step, ``model_inputs`` what the selector reads per step
        (:class:`~kvsieve.selectors.dsa.IndexerInputs`, kvsieve order) -> an
        :class:`~kvsieve.sparse.backends.AttentionResult` (``out [T, Hq, D]``, ``attended [T, Hkv]``,
        ``paths``: each phase's path). The selector is asked only about the rows of its plan's phases
        present this step, exactly as :meth:`SparseAttention.forward` asks it (same inputs, same
        placement of its answer). ``host``: the host engine's own kernels on this layer call
        (:mod:`.host`; ``None`` on CUDA); the capture then also compares dense calls with the host's
        own attention. ``lse`` is ``None`` on every path but the backend's."""
        md = step.metadata
        params = self.select(q, k, v, md, model_inputs, settings=step.row_settings,
                             requests_metadata=step.requests_metadata)
        view, i = step.view, self.layer_idx
        route = route_rows(md, params, host=host is not None,
                           runs_kernel=lambda: runs_kernel_takes(view.k_cache(i), view.v_cache(i), q, self.geometry))
        res = self._attend(q, step, params, route, host)
        if self.capture is not None:
            self.capture.record(i, self.geometry, self.plan, q, md, params, res,
                                None if host is None else step.to_kvsieve(host.dense()))
        return res

    def _attend(self, q: torch.Tensor, step: PreparedStep, params: SparseRuntimeParams | None, route: RowsRoute,
                host: HostAttention | None) -> AttentionResult:
        """The step's attention on ``route``'s paths (:func:`.router.route_rows`)."""
        md, g, paths = step.metadata, self.geometry, route.paths
        ctx, gen = paths.get("context"), paths.get("generation")
        if host is not None and set(paths.values()) <= {HOST_DENSE}:  # the host's own attention, whole
            attended = md.token_kv_lens.to(torch.int64)[:, None].expand(-1, g.num_kv_heads)
            view, i = step.view, self.layer_idx
            if verify_pass(md, view.k_cache(i), view.v_cache(i), q, g):  # each context read once, not per row
                return AttentionResult(causal_attention(q, md, view, i, g), None, attended,
                                       dict.fromkeys(paths, CAUSAL_ROWS))
            return AttentionResult(step.to_kvsieve(host.dense()), None, attended, dict(paths))
        if ctx == SDPA_DENSE:
            return self._dense_context_first(q, step, params)
        if ctx == NATIVE_RUNS:
            return self._positions_on_host(q, step, params, route, host)
        if ctx == HOST_DENSE:  # a mixed step: the prompt rows (dense) from the host's own attention, copied
            # (host.dense() stays the host's own output: the capture compares with it)
            out = step.to_kvsieve(host.dense()).clone()
            attended = md.token_kv_lens.to(torch.int64)[:, None].repeat(1, g.num_kv_heads)
            rows = md.generation_rows
            if gen == BACKEND:  # on the decode rows' sub-step
                sub = self.backend.forward(q[rows], step.generation_metadata(), self.layer_idx, g,
                                           _rows_params(params, rows))
                out[rows], attended[rows], path = sub.out, sub.attended, sub.paths["generation"]
            else:
                out[rows], attended[rows], path = self._generation_on_host(q[rows], step, params, route, host)
            return AttentionResult(out, None, attended, {"context": HOST_DENSE, "generation": path})
        if gen in (HOST_PAGED, NATIVE_RUNS):  # a decode-only step: every row is a generation row
            out, attended, path = self._generation_on_host(q, step, params, route, host)
            return AttentionResult(out, None, attended, {"generation": path})
        return self.backend.forward(q, md, self.layer_idx, g, params)

    def _positions_on_host(self, q: torch.Tensor, step: PreparedStep, params: SparseRuntimeParams,
                           route: RowsRoute, host: HostAttention) -> AttentionResult:
        """Every phase selects positions (a prompt under DSA): the prompt rows, each with its causal
        length, through kvsieve's native prompt kernel on runs of the host's cache read in place
        (:func:`.host.token_runs`, ``_RUN_ROWS`` rows per call to bound the runs' size), the generation
        rows as :meth:`_generation_on_host` takes them."""
        md, g = step.metadata, self.geometry
        out = q.new_empty(md.num_tokens, g.num_q_heads, g.value_dim)
        attended = torch.empty(md.num_tokens, g.num_kv_heads, dtype=torch.int64)
        rows = md.context_rows
        for r0 in range(rows.start, rows.stop, _RUN_ROWS):
            chunk = slice(r0, min(r0 + _RUN_ROWS, rows.stop))
            runs = token_runs(params, md, step.view, chunk)
            out[chunk] = native_runs_attention(q[chunk], runs, step.view, self.layer_idx, g, prompt=True)
            attended[chunk] = torch.from_numpy(runs.attended)
        paths = {"context": NATIVE_RUNS}
        if "generation" in route.paths:
            gen = md.generation_rows
            out[gen], attended[gen], paths["generation"] = self._generation_on_host(q[gen], step, params, route, host)
        return AttentionResult(out, None, attended, paths)

    def _generation_on_host(self, q: torch.Tensor, step: PreparedStep, params: SparseRuntimeParams,
                            route: RowsRoute, host: HostAttention) -> tuple[torch.Tensor, torch.Tensor, str]:
        """The generation rows' selected attention on ``route``'s host path: q ``[N, Hq, D]`` (those
        rows) -> ``(out [N, Hq, D], attended [N, Hkv] int64, path)``. :data:`.router.HOST_PAGED`: the
        host's paged kernel on the route's per-head block tables; :data:`.router.NATIVE_RUNS`:
        kvsieve's native kernel on per-(row, KV head) runs read in place from the view."""
        g = self.geometry
        hkv = g.num_kv_heads
        if route.paths["generation"] == HOST_PAGED:
            tables = route.tables
            paged = host.paged_per_head(q.reshape(-1, g.num_q_heads // hkv, g.head_dim), tables)
            return paged.view(-1, g.num_q_heads, g.value_dim), tables.seq_lens.view(-1, hkv).to(torch.int64), HOST_PAGED
        runs = token_runs(params, step.metadata, step.view)
        return native_runs_attention(q, runs, step.view, self.layer_idx, g), torch.from_numpy(runs.attended), NATIVE_RUNS

    def select(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata,
               model_inputs: object = None, *, settings: tuple[RequestSetting | None, ...] | None = None,
               requests_metadata: RequestsMetadata | None = None) -> SparseRuntimeParams | None:
        """The plan's selector on this step (:func:`~kvsieve.sparse.selector_step.run_selector`, the
        steps kvsieve's own layer runs after its K/V write; vLLM wrote the K/V) -> its validated answer
        placed in the step's rows, ``None`` = dense. ``model_inputs``: what the selector declares it
        reads per step (checked as kvsieve's layer checks them); ``settings``: each request row's
        per-request setting (:attr:`PreparedStep.row_settings`), the selector then running per
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

    def _dense_context_first(self, q: torch.Tensor, step: PreparedStep, params: SparseRuntimeParams | None
                             ) -> AttentionResult:
        """Context rows through :func:`dense_context_rows` (:data:`.router.SDPA_DENSE`); generation rows (if
        any) through the backend on :meth:`PreparedStep.generation_metadata` with ``params`` cut to
        their rows."""
        md, g = step.metadata, self.geometry
        out = q.new_empty(md.num_tokens, g.num_q_heads, g.value_dim)
        out[md.context_rows] = dense_context_rows(q, md, self.layer_idx, g)
        paths, skipped, walked = {"context": SDPA_DENSE}, 0, 0
        if "generation" in md.phases():
            rows = md.generation_rows
            sub = self.backend.forward(q[rows], step.generation_metadata(), self.layer_idx, g,
                                       _rows_params(params, rows))
            out[rows] = sub.out
            paths["generation"], skipped, walked = sub.paths["generation"], sub.skipped_tiles, sub.walked_tiles
        return AttentionResult(out, None, self.backend.effective_attended_tokens(params, md, g), paths, skipped, walked)


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
