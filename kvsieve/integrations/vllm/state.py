"""The plug-in's per-process state, shared by every attention layer of the process and kept for its
life: the config, the per-layer plans (one selector instance, as in the rest of kvsieve), the
kvsieve backend, and the caches the layer calls fill on first use — one
:class:`~.step.StepTranslator` (view + metadata) per cache geometry, one
:class:`~.layer.LayerRunner` per layer, one one-call decode path per (layer, setting). Built when
vLLM builds the first attention layer (``get_current_vllm_config()`` is set then), after the
engine-wide refusals (:mod:`.startup`); reads the vLLM config only through plain attributes, so it
imports nothing from vLLM."""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...metadata.foreign_paged import ForeignKVSpec, ForeignPagedKV
from ...selectors.dsa import IndexerInputs
from ...sparse import AttentionGeometry
from .config import PluginConfig, WorkerRanks, read_plugin_config
from .draft_checks import check_speculation
from .draft_steps import uses_drafter
from .host import HostAttention
from .indexer_feed import IndexerFeed
from .layer import LayerRunner, make_backend
from .layouts import kv_views
from .native_decode import DeviceDecodeLayer, NativeDecodeLayer, decode_layer_path
from .request_settings import RequestSetting
from .setting_groups import MAX_VARIANTS, plan_with_setting
from .startup import check_engine, check_indexer_model, check_projections, lower_plans
from .state_check import StateCheck
from .step import PreparedStep, StepTranslator, VllmStep

__all__ = ["PluginState", "current_plugin_state", "plugin_state", "served_line"]

_STATE: PluginState | None = None
_LOG = logging.getLogger("vllm.kvsieve")  # a child of vLLM's logger: its handler and level


class PluginState:
    """``vllm_config`` fields read: ``model_config.max_model_len``, ``model_config.hf_config
    .num_hidden_layers`` (and ``.hidden_size`` for a selector reading the indexer),
    ``scheduler_config.max_num_seqs`` / ``max_num_batched_tokens``,
    ``parallel_config.decode_context_parallel_size`` / ``prefill_context_parallel_size``,
    ``compilation_config.mode`` (a selector reading the indexer needs the eager model, mode 0).

    ``indexer_layers``: the layers whose plan reads :class:`IndexerInputs` (DSA); their hidden
    states come through :attr:`feed` (:meth:`start_indexer_feed`, :mod:`.indexer_feed`).

    Under tensor / pipeline parallelism each worker process has its own state: its layers see
    their shard of the heads (the geometry comes from the layer, never from the model config) and,
    on a pipeline stage, only that stage's layers, by their global index; ``ranks`` says which
    worker this is (recorded with every captured call)."""

    def __init__(self, config: PluginConfig, vllm_config: Any, device: torch.device,
                 ranks: WorkerRanks = WorkerRanks()) -> None:
        check_engine(vllm_config)
        self.config = config
        self.device = device
        self.ranks = ranks
        self.backend = make_backend(config.backend, device)
        self.num_layers = int(vllm_config.model_config.hf_config.num_hidden_layers)
        self.plans = lower_plans(config, num_layers=self.num_layers, backend_name=self.backend.name,
                                 device=device.type, tensor_parallel_size=ranks.tp_size)
        check_speculation(vllm_config, config, self.plans, device=device.type)
        self.speculating = uses_drafter(vllm_config)  # the selector serves kvsieve's draft passes alone
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.max_num_seqs = int(vllm_config.scheduler_config.max_num_seqs)
        self.max_num_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
        self.translators: dict[tuple, StepTranslator] = {}
        self.runners: dict[int, LayerRunner] = {}
        # (layer, setting) -> (cache address, path); the settings of a layer: the last MAX_VARIANTS
        self.decode_paths: OrderedDict[tuple[int, RequestSetting | None],
                                       tuple[int, NativeDecodeLayer | DeviceDecodeLayer | None]] = OrderedDict()
        self.state_check = StateCheck() if config.check_state else None  # shared by the layers
        self.indexer_layers = frozenset(i for i, p in enumerate(self.plans)
                                        if p is not None and p.selector.model_inputs_type is IndexerInputs)
        self.feed: IndexerFeed | None = None
        check_indexer_model(vllm_config, self.plans)

    def start_indexer_feed(self, is_plugin_layer: Callable[[nn.Module], bool],
                           layer_index: Callable[[nn.Module], int]) -> None:
        """Start feeding :attr:`indexer_layers` their hidden states (once per process; nothing without
        such layers). ``is_plugin_layer``: whether a module is an attention layer the plug-in's selector
        runs on (not a sliding-window one left to vLLM); ``layer_index``: its global index."""
        if self.indexer_layers and self.feed is None:
            self.feed = IndexerFeed(set(self.indexer_layers), is_plugin_layer, layer_index,
                                    on_found=lambda layers: check_projections(self.plans, layers))

    def translator(self, layout: str, raw: torch.Tensor, k: torch.Tensor) -> StepTranslator:
        n, h, p, d = k.shape
        key = (layout, n, h, p, d, k.dtype)
        if key not in self.translators:
            spec = ForeignKVSpec(num_layers=self.num_layers, num_blocks=n, tokens_per_block=p, num_kv_heads=h,
                                 head_dim=d, dtype=k.dtype, device=k.device, layout=layout,
                                 # a recomputed request's prompt and generated tokens are two kvsieve requests
                                 max_requests=2 * self.max_num_seqs, max_blocks_per_seq=-(-self.max_model_len // p))
            # block_lists: read by the Vanilla golden of the capture only
            golden = ("block_lists",) if self.config.capture_dir is not None else ()
            needed = tuple(sorted({*golden, *self.backend.required_translations}))
            self.translators[key] = StepTranslator(ForeignPagedKV(spec), max_num_tokens=self.max_num_tokens,
                                                   translations=needed)
        return self.translators[key]

    def runner(self, layer_idx: int, geometry: AttentionGeometry) -> LayerRunner:
        """The layer's runner (built on first use): ``geometry`` the layer's heads on this worker."""
        if layer_idx not in self.runners:
            if not 0 <= layer_idx < self.num_layers:
                raise ValueError(f"kvsieve vLLM plug-in: layer index {layer_idx} outside the model's "
                                 f"{self.num_layers} layers")
            self.runners[layer_idx] = LayerRunner(layer_idx=layer_idx, geometry=geometry, plan=self.plans[layer_idx],
                                                  backend=self.backend, capture_dir=self.config.capture_dir,
                                                  ranks=self.ranks, state_check=self.state_check)
        return self.runners[layer_idx]

    def decode_path(self, layer_idx: int, layout: str, kv_cache: torch.Tensor, geometry: AttentionGeometry,
                    setting: RequestSetting | None = None) -> NativeDecodeLayer | DeviceDecodeLayer | None:
        """The layer's one-call decode path (:mod:`.native_decode`) over ``kv_cache`` for a step whose
        rows all carry ``setting`` (``None``: the process default; :func:`.setting_groups.one_setting`),
        decided once per layer, setting and cache: the path a process started with that setting
        runs, over the same pools; ``None`` where it has none, and always while the golden capture is on
        (every call then takes :class:`~.layer.LayerRunner`, which compares with the golden). With the
        state check on, the caller checks each native step afterwards
        (:meth:`.state_check.StateCheck.check_one_call`)."""
        key = (layer_idx, setting)
        have = self.decode_paths.get(key)
        if have is not None and have[0] == kv_cache.data_ptr():
            self.decode_paths.move_to_end(key)
            return have[1]
        path = None
        if self.config.capture_dir is None:
            k_view, v_view = kv_views(layout, kv_cache)
            view = self.translator(layout, kv_cache, k_view).view
            runner = self.runner(layer_idx, geometry)
            path = decode_layer_path(plan_with_setting(runner.plan, setting), view, layer_idx, k_view, v_view,
                                     runner.geometry)
        self.decode_paths[key] = (kv_cache.data_ptr(), path)
        if len(self.decode_paths) > self.num_layers * (MAX_VARIANTS + 1):  # settings no longer served
            self.decode_paths.popitem(last=False)
        return path

    def prepare(self, layer_idx: int, layout: str, kv_cache: torch.Tensor, step: VllmStep) -> PreparedStep:
        """``step`` prepared over the view of ``kv_cache``'s geometry, bound to the layer's cache."""
        k_view, v_view = kv_views(layout, kv_cache)
        tr = self.translator(layout, kv_cache, k_view)
        tr.view.bind_layer(layer_idx, kv_cache, k_view, v_view)
        return tr.prepare(step)

    def native_layers(self) -> list[int]:
        """The layers whose decode steps have taken the one-call path so far in this process."""
        return sorted({i for (i, _), (_, path) in self.decode_paths.items() if path is not None})

    def host_only(self, layer_idx: int) -> bool:
        """Whether the layer is left whole to the host's own attention: no plan and nothing to capture."""
        return 0 <= layer_idx < self.num_layers and self.plans[layer_idx] is None and self.config.capture_dir is None

    def run_layer(self, layer_idx: int, layout: str, kv_cache: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, output: torch.Tensor, *, step: VllmStep, geometry: AttentionGeometry,
                  host: HostAttention | None = None, indexer_hidden: torch.Tensor | None = None) -> torch.Tensor:
        """One layer of one step on the selector path (:data:`.router.SELECTED`): q ``[T, H, D]``, k/v
        ``[T, Hkv, D]`` (vLLM's token order, K/V already in ``kv_cache``), ``step`` vLLM's step tables
        (read once per step, by the caller); writes ``output [T, H, D]`` (or ``[T, H*D]``) and returns it.
        ``host``: vLLM's own kernels on this layer call (:meth:`.layer.LayerRunner.forward`);
        ``indexer_hidden [T, hidden_size]``: the layer's hidden state (vLLM's token order) for a
        layer in :attr:`indexer_layers`, handed to its selector as :class:`IndexerInputs`."""
        if step.num_tokens != query.shape[0]:
            raise ValueError(f"vLLM step of {step.num_tokens} tokens, layer call of {query.shape[0]}")
        prepared = self.prepare(layer_idx, layout, kv_cache, step)
        model_inputs = None if indexer_hidden is None else IndexerInputs(hidden=prepared.to_kvsieve(indexer_hidden))
        out = self.runner(layer_idx, geometry).forward(
            prepared.to_kvsieve(query), prepared.to_kvsieve(key), prepared.to_kvsieve(value), prepared, host,
            model_inputs=model_inputs).out
        prepared.to_vllm(out.to(output.dtype), output.view(query.shape[0], geometry.num_q_heads, geometry.head_dim))
        return output


def current_plugin_state() -> PluginState | None:
    """This process's state, or ``None`` before vLLM built a plug-in layer (or without the plug-in)."""
    return _STATE


def plugin_state(vllm_config: Any, device: torch.device, ranks: WorkerRanks) -> PluginState:
    """The process's state, built on first use from the plug-in config (the environment's or
    ``vllm_config.additional_config``'s ``kvsieve`` entry), logging :func:`served_line`; ``ranks``:
    the worker this process is (one state per process, so per tensor-parallel rank and stage)."""
    global _STATE
    if _STATE is None:
        config = read_plugin_config(additional=getattr(vllm_config, "additional_config", None))
        if config is None:
            raise RuntimeError("kvsieve's vLLM backend is in use but neither KVSIEVE_SELECTOR, KVSIEVE_CONFIG nor "
                               "--additional-config's 'kvsieve' entry is set")
        _STATE = PluginState(config, vllm_config, device, ranks)
        _LOG.info("%s", served_line(_STATE))
    return _STATE


def _ranges(layers: list[int]) -> str:
    spans: list[list[int]] = []
    for i in layers:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans) or "none"


def served_line(state: PluginState) -> str:
    """What the process serves, in one line: the selector and its fields (the budget among them),
    the layers it selects in and the dense ones, its phases, the kvsieve backend and the config's source."""
    where = f"kvsieve (tp rank {state.ranks.tp_rank}, stage {state.ranks.pp_rank}; {state.config.source})"
    selecting = [i for i, p in enumerate(state.plans) if p is not None]
    if not selecting:
        return f"{where} serves dense attention on all {state.num_layers} layers"
    plan = state.plans[selecting[0]]
    fields = ", ".join(f"{k}={v}" for k, v in getattr(plan.selector.config, "__dict__", {}).items())
    dense = [i for i, p in enumerate(state.plans) if p is None]
    return (f"{where} serves selector {plan.selector.name!r} ({fields}) on layers {_ranges(selecting)} of "
            f"{state.num_layers} (dense: {_ranges(dense)}), phases {sorted(plan.phases)}, backend {state.backend.name!r}")
