"""Which path one attention layer call takes: the one router the CPU and CUDA adapters share (free
of vLLM imports). Each path has a name; docs/vllm.md's "what runs where" table has one row per name.

Before the selector runs, per layer call (:func:`route_call`):

* :data:`DUMMY_STEP`: vLLM's own profile and warm-up runs (``_dummy_run``, which on vLLM 0.32's CPU
  runner and in eager mode builds no attention metadata: the layer is called with ``attn_metadata=None``).
  Nothing is read, no prompt length asked; the output is vLLM's to discard.
* :data:`HOST_WHOLE`: vLLM's own attention, the whole layer untouched (CPU: a sliding-window layer,
  or a layer with no plan and nothing captured).
* :data:`ONE_CALL_DECODE`: a decode step (every row one request's one new generated token) whose rows
  all carry one setting a selector runs, on a layer whose selector has a native program: one call
  (:mod:`.native_decode`; on CUDA the fixed-shape device path).
* :data:`SELECTED`: anything else: the step is translated (:mod:`.step`), the layer's selector runs
  (:class:`.layer.LayerRunner`), then each phase's rows take a path of :func:`route_rows`.

After the selector, per phase present (:func:`route_rows`; the host's kernels exist on CPU only):

* :data:`HOST_DENSE`: rows the selection leaves dense, by the host's own kernel on its own metadata.
* :data:`HOST_PAGED`: generation rows selecting whole cache blocks, by the host's paged kernel on
  per-(row, KV head) block tables (:func:`.host.per_head_block_tables`).
* :data:`NATIVE_RUNS`: any other position selection (generation rows; prompt rows when every phase
  present selects positions), by kvsieve's native kernel on per-(row, KV head) runs of the host's
  cache read in place (:func:`.host.token_runs`).
* :data:`CAUSAL_ROWS`: a verify pass of lossless decoding (a dense step under kvsieve's drafter, a few
  query tokens a request), by kvsieve's causal-rows kernel, each request's context read once for all
  its rows (:func:`.host.verify_pass`; decided in :class:`.layer.LayerRunner` where the step is
  :data:`HOST_DENSE` whole).
* :data:`SDPA_DENSE`: dense prompt rows without the host's kernels: SDPA over a block-wise gather
  (:func:`.layer.dense_context_rows`).
* :data:`BACKEND`: the kvsieve backend (its own path names appear in the capture's ``paths``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ...metadata import AttentionMetadata
from ...sparse import SparseRuntimeParams
from ...sparse.params import is_dense
from .host import PerHeadTables, per_head_block_tables
from .request_settings import RequestSetting
from .setting_groups import one_setting

__all__ = ["DUMMY_STEP", "HOST_WHOLE", "ONE_CALL_DECODE", "SELECTED", "HOST_DENSE", "HOST_PAGED", "NATIVE_RUNS",
           "CAUSAL_ROWS", "SDPA_DENSE", "BACKEND", "CallRoute", "RowsRoute", "route_call", "route_rows", "refuse_step"]

DUMMY_STEP = "dummy_step"
HOST_WHOLE = "host_whole"
ONE_CALL_DECODE = "one_call_decode"
SELECTED = "selected"
HOST_DENSE = "host_dense"
HOST_PAGED = "host_paged"
NATIVE_RUNS = "native_runs"
CAUSAL_ROWS = "causal_rows"
SDPA_DENSE = "sdpa_dense"
BACKEND = "backend"

OneCall = TypeVar("OneCall")


@dataclass(frozen=True)
class CallRoute(Generic[OneCall]):
    """:func:`route_call`'s answer: ``path`` one of :data:`DUMMY_STEP`, :data:`HOST_WHOLE`,
    :data:`ONE_CALL_DECODE` (``one_call``: the layer's bound one-call path), :data:`SELECTED`."""

    path: str
    one_call: OneCall | None = None


def refuse_step(*, quantized_output: bool, causal: bool | None) -> None:
    """What no path computes, refused at the step: fused output quantization (``output_scale``), and
    non-causal attention (``causal``: ``None`` on vLLM's dummy steps, which carry no metadata)."""
    if quantized_output:
        raise NotImplementedError("kvsieve vLLM plug-in: fused output quantization (output_scale) is not supported")
    if causal is False:
        raise NotImplementedError("kvsieve vLLM plug-in: non-causal attention steps are not supported")


def route_call(*, has_metadata: bool, host_whole: bool,
               decode_step: Callable[[], tuple[bool, tuple[RequestSetting | None, ...] | None]],
               one_call: Callable[[RequestSetting | None], OneCall | None]) -> CallRoute[OneCall]:
    """The layer call's path before any selector runs (module docstring). ``has_metadata``: vLLM built
    the step's attention metadata (``False`` on its dummy steps); ``host_whole``: the adapter leaves
    this layer whole to the host's own attention; ``decode_step()``: whether every row is one
    request's one new generated token, and the rows' per-request settings (asked only past the
    first two); ``one_call(setting)``: the layer's one-call decode path for rows all of ``setting``
    (``None``: the process default), ``None`` where it has none."""
    if not has_metadata:
        return CallRoute(DUMMY_STEP)
    if host_whole:
        return CallRoute(HOST_WHOLE)
    decode, settings = decode_step()
    if decode:
        one, setting = one_setting(settings)
        layer = one_call(setting) if one else None
        if layer is not None:
            return CallRoute(ONE_CALL_DECODE, layer)
    return CallRoute(SELECTED)


@dataclass(frozen=True)
class RowsRoute:
    """:func:`route_rows`'s answer: ``paths`` maps each phase present to its path; ``tables`` are the
    generation rows' per-head block tables when their path is :data:`HOST_PAGED`."""

    paths: dict[str, str]
    tables: PerHeadTables | None = None


def route_rows(md: AttentionMetadata, params: SparseRuntimeParams | None, *, host: bool,
               runs_kernel: Callable[[], bool]) -> RowsRoute:
    """Each phase's path once the selection ``params`` (``None`` = dense) of the step ``md`` is known
    (module docstring). ``host``: the host's kernels are there (CPU); ``runs_kernel()``: kvsieve's
    native runs kernel takes this layer's cache and geometry (:func:`.host.runs_kernel_takes`).

    With the host's kernels and no skip-softmax threshold: every phase dense -> :data:`HOST_DENSE`;
    every phase selecting positions, prompt rows among them -> :data:`NATIVE_RUNS` for the prompt
    rows (when the kernel takes the cache) and the generation rows as below; dense prompt rows (or
    none) and selecting generation rows -> :data:`HOST_DENSE` for the prompt rows and, for the
    generation rows, :data:`HOST_PAGED` where the selection is whole cache blocks every (row, KV head)
    selects some of, else :data:`NATIVE_RUNS` where the kernel takes the cache, else :data:`BACKEND`
    (on their own sub-step; a step of generation rows alone then goes whole to the backend). What is
    left: dense prompt rows :data:`SDPA_DENSE` (and the generation rows :data:`BACKEND`, on their
    sub-step), else every row :data:`BACKEND`."""
    phases = md.phases()
    thresholds = any(params is not None and params.threshold_scale_factor(p) > 0 for p in phases)
    if host and not thresholds:
        if all(is_dense(params, p) for p in phases):
            return RowsRoute(dict.fromkeys(phases, HOST_DENSE))
        selects = {p: params.selects_positions(p) for p in phases}
        if selects.get("context", False):
            if all(selects.values()) and runs_kernel():
                tables = per_head_block_tables(params, md, md.kv_cache_manager) if "generation" in phases else None
                paths = {"context": NATIVE_RUNS}
                if "generation" in phases:
                    paths["generation"] = HOST_PAGED if tables is not None else NATIVE_RUNS
                return RowsRoute(paths, tables)
        elif "generation" in phases:  # the generation rows select (not every phase is dense)
            tables = per_head_block_tables(params, md, md.kv_cache_manager)
            gen = HOST_PAGED if tables is not None else NATIVE_RUNS if runs_kernel() else None
            if "context" in phases:
                return RowsRoute({"context": HOST_DENSE, "generation": gen or BACKEND}, tables)
            if gen is not None:
                return RowsRoute({"generation": gen}, tables)
    if "context" in phases and is_dense(params, "context"):
        return RowsRoute({"context": SDPA_DENSE, **({"generation": BACKEND} if "generation" in phases else {})})
    return RowsRoute(dict.fromkeys(phases, BACKEND))
