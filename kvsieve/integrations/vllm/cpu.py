"""vLLM's CPU attention backend (``CPU_ATTN``) with kvsieve computing the attention: a thin adapter
from vLLM's objects to the plug-in's router (:mod:`.router`).

:class:`KvsieveCPUAttentionBackend` keeps vLLM's cache shape, metadata builder and KV write
(``do_kv_cache_update``, run by vLLM before ``forward``). Its metadata builder copies the step's
tables to the host once per step, with each row's per-request setting and prompt length
(:class:`KvsieveCPUAttentionMetadata`), and keeps vLLM's KV write in a layout kvsieve can view in
each KV cache group holding a layer kvsieve reads: the ``amx`` ISA (which packs K for AMX tiles) is
replaced by ``vec`` there, checked at start-up by writing known values through vLLM's own op
(:func:`.startup.probe_cpu_layout`); a group of layers left whole to vLLM keeps vLLM's ISA.
``forward`` asks :func:`.router.route_call` for the layer call's path and runs it: vLLM's dummy
steps return untouched, a layer left whole to vLLM runs vLLM's own forward, a decode step the
one-call path takes runs it on the step's host tables, and everything else runs the layer's
selector and each phase's path (:meth:`.state.PluginState.run_layer`) with vLLM's own kernels at
hand (:class:`VllmHostAttention`: ``host_dense``, ``host_paged``).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.config import get_current_vllm_config, get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from ...selectors.dsa import IndexerInputs
from ...sparse import AttentionGeometry
from .draft_steps import FIRST_DRAFT_STEP, OWN_STEP, record, step_kind, uses_drafter
from .host import PerHeadTables
from .request_settings import RequestSetting, row_prompt_lens, row_settings
from .router import DUMMY_STEP, HOST_WHOLE, ONE_CALL_DECODE, refuse_step, route_call
from .startup import probe_cpu_layout, refuse_layer_features, refusing_backend, worker_ranks
from .state import PluginState, current_plugin_state, plugin_state
from .step import VllmStep

__all__ = ["KvsieveCPUAttentionBackend", "KvsieveCPUAttentionImpl", "KvsieveCPUAttentionMetadata",
           "KvsieveCPUMetadataBuilder", "RefuseMLABackend", "VllmHostAttention"]

LAYOUT = "vllm-cpu"
VIEWABLE_ISAS = ("vec", "vec16")


@dataclass
class KvsieveCPUAttentionMetadata(CPUAttentionMetadata):
    """vLLM's step metadata and kvsieve's host copy of its tables (read once per step, not per layer)."""

    step: VllmStep | None = None


class KvsieveCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's builder with the KV write kept in a layout kvsieve can view (``vec``/``vec16``); its
    metadata also carries the step's tables on the host, each row's per-request setting and its
    request's prompt length (:class:`KvsieveCPUAttentionMetadata`, :mod:`.request_settings`). A KV
    cache group none of whose layers kvsieve reads (each one vLLM's own attention whole: a sliding-window
    layer, or a layer without a plan and nothing to capture) gets neither: vLLM's own ISA (``amx`` for
    bf16 on CPUs with AMX) and metadata. So dense through the plug-in is vLLM's attention, and Gemma 3's
    sliding-window group keeps vLLM's kernel choice when its full-attention layers select."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:  # noqa: ANN001 (vLLM's signature)
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        state = current_plugin_state()
        self.speculating = uses_drafter(vllm_config)  # under kvsieve's drafter (:mod:`.draft_steps`)
        layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names).values()
        self.reads_cache = state is None or any(
            _selecting_layer(layer) and not state.host_only(extract_layer_index(layer.layer_name)) for layer in layers)
        if self.reads_cache:
            if self.isa not in VIEWABLE_ISAS:
                self.isa = "vec" if self.block_size % 32 == 0 else "vec16"
                self._set_isa_to_layers(layer_names)
            probe_cpu_layout(ops.cpu_attn_reshape_and_cache, self.isa, self.dtype, self.block_size, self.head_dim,
                             self.num_kv_heads, LAYOUT)

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False  # noqa: ANN001
              ) -> KvsieveCPUAttentionMetadata:
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        kind = step_kind(self.speculating)
        if kind == OWN_STEP:  # the drafter builds its steps from this one (:mod:`.draft_steps`)
            record(self, common_attn_metadata)
        step = None
        if self.reads_cache:
            step = _host_step(md, md.seq_lens.shape[0], kind)
        return KvsieveCPUAttentionMetadata(**{f.name: getattr(md, f.name) for f in fields(md)}, step=step)


def _host_step(md: CPUAttentionMetadata, rows: int, kind: str | None) -> VllmStep:
    """The step's tables on the host. Without kvsieve's drafter (``kind`` ``None``): with each row's
    prompt length (refused by name where the batch table does not know a row) and per-request
    setting. Under it (:mod:`.draft_steps`): a step vLLM runs itself is dense, every query token a
    context token; a draft step's every row is one generated token (its prompt ends before it), the
    round's first recomputing each row's newest page before it selects (:mod:`.draft_steps`)."""
    if kind is None:
        return VllmStep.from_tensors(md.query_start_loc, md.seq_lens, md.block_table, md.num_actual_tokens,
                                     prompt_lens=row_prompt_lens(rows), settings=row_settings(rows))
    seq_lens = md.seq_lens[:rows].cpu().numpy().astype(np.int32)
    return VllmStep.from_tensors(md.query_start_loc, md.seq_lens, md.block_table, md.num_actual_tokens,
                                 prompt_lens=seq_lens if kind == OWN_STEP else seq_lens - 1, dense=kind == OWN_STEP,
                                 refresh_pages=kind == FIRST_DRAFT_STEP)


class KvsieveCPUAttentionImpl(CPUAttentionBackendImpl):
    """``forward`` runs kvsieve over vLLM's cache; everything else is vLLM's."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None) -> None:
        # a sliding-window layer (Gemma 3's local layers) is vLLM's own attention, whole (forward)
        refuse_layer_features(alibi_slopes=alibi_slopes, sliding_window=None, logits_soft_cap=logits_soft_cap,
                              attn_type=attn_type, kv_sharing_target_layer_name=kv_sharing_target_layer_name,
                              sinks=sinks, kv_cache_dtype=kv_cache_dtype)
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        self.state: PluginState = plugin_state(get_current_vllm_config(), device=torch.device("cpu"),
                                               ranks=worker_ranks())
        self.state.start_indexer_feed(_selecting_layer, lambda module: extract_layer_index(module.layer_name))
        self.geometry = AttentionGeometry(kind="gqa", num_q_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                          head_dim=self.head_size, sm_scale=self.scale)
        self._layer_idx: int | None = None  # this layer's index, read from its name at the first forward

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,  # noqa: ANN001
                kv_cache: torch.Tensor, attn_metadata: KvsieveCPUAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None
                ) -> torch.Tensor:
        md = attn_metadata
        refuse_step(quantized_output=output_scale is not None or output_block_scale is not None,
                    causal=None if md is None else bool(md.causal) and md.dynamic_causal is None)
        if self._layer_idx is None:
            self._layer_idx = extract_layer_index(layer.layer_name)
        layer_idx, state, steps = self._layer_idx, self.state, []

        def decode_step() -> tuple[bool, tuple[RequestSetting | None, ...] | None]:
            # the builder's host copy; None: metadata vLLM built without the plug-in's builder
            steps.append(getattr(md, "step", None) or _host_step(md, md.seq_lens.shape[0], step_kind(state.speculating)))
            return steps[0].decode_only, steps[0].settings

        route = route_call(
            has_metadata=md is not None, decode_step=decode_step,
            host_whole=self.sliding_window != -1 or state.host_only(layer_idx),
            one_call=lambda setting: state.decode_path(layer_idx, LAYOUT, kv_cache, self.geometry, setting))
        if route.path == DUMMY_STEP:
            return output
        if route.path == HOST_WHOLE:  # vLLM's own attention, nothing else
            return super().forward(layer, query, key, value, kv_cache, md, output)
        n, step = md.num_actual_tokens, steps[0]
        hidden = None
        if layer_idx in state.indexer_layers:  # DSA: the layer's hidden state, kept by its attention module
            hidden = state.feed.take(layer_idx, n, query.shape[0])
        if route.path == ONE_CALL_DECODE:
            model_inputs = None if hidden is None else IndexerInputs(hidden=hidden)
            if step.refresh_pages:
                route.one_call.refresh_pages(step.block_table, step.seq_lens)
            route.one_call.run(step.block_table, step.seq_lens, step.positions, query[:n],
                               output[:n].view(n, self.num_heads, self.head_size), model_inputs)
            if state.state_check is not None:  # debug: the pools the one call left, checked
                state.state_check.check_one_call(
                    state.runner(layer_idx, self.geometry).plan, layer_idx, self.geometry, query[:n], key[:n],
                    value[:n], state.prepare(layer_idx, LAYOUT, kv_cache, step).metadata, model_inputs)
            return output
        state.run_layer(layer_idx, LAYOUT, kv_cache, query[:n], key[:n], value[:n], output[:n], step=step,
                        geometry=self.geometry, host=VllmHostAttention(self, layer, query, key, value, kv_cache, md),
                        indexer_hidden=hidden)
        return output


def _selecting_layer(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a vLLM attention layer whose selector the plug-in runs (its impl is the
    plug-in's and it has no sliding window: those layers are vLLM's own attention, whole)."""
    impl = getattr(module, "impl", None)
    return isinstance(impl, KvsieveCPUAttentionImpl) and impl.sliding_window == -1


class VllmHostAttention:
    """vLLM's own CPU kernels on one layer call (:class:`.host.HostAttention`): ``dense`` is
    ``CPU_ATTN``'s forward on vLLM's step metadata; ``paged_per_head`` is vLLM's
    ``cpu_attention_with_kv_cache`` over the cache seen as ``[num_blocks * Hkv, 1, block_size, 2*D]``
    (pseudo-block ``b * Hkv + h`` = block ``b`` of KV head ``h``, one contiguous ``[2*D, block_size]``
    tile per (block, head) in the ``vec``/``vec16`` layouts) with one pseudo-request per (row, KV head)."""

    def __init__(self, impl: KvsieveCPUAttentionImpl, layer, query: torch.Tensor, key: torch.Tensor,  # noqa: ANN001
                 value: torch.Tensor, kv_cache: torch.Tensor, md: CPUAttentionMetadata) -> None:
        self.impl, self.layer, self.md = impl, layer, md
        self.query, self.key, self.value, self.kv_cache = query, key, value, kv_cache
        self._dense: torch.Tensor | None = None

    def dense(self) -> torch.Tensor:
        if self._dense is None:
            impl, n = self.impl, self.md.num_actual_tokens
            out = self.query.new_empty(self.query.shape[0], impl.num_heads * impl.head_size)
            CPUAttentionBackendImpl.forward(impl, self.layer, self.query, self.key, self.value, self.kv_cache, self.md,
                                            out)
            self._dense = out[:n].view(n, impl.num_heads, impl.head_size)
        return self._dense

    def paged_per_head(self, q: torch.Tensor, tables: PerHeadTables) -> torch.Tensor:
        num_blocks, hkv, block_size, two_d = self.kv_cache.shape
        key_cache, value_cache = self.kv_cache.view(num_blocks * hkv, 1, 2 * block_size, two_d // 2).chunk(2, dim=2)
        q = q.contiguous()
        rows = q.shape[0]
        starts = torch.arange(rows + 1, dtype=torch.int32)
        sched = _scheduler_metadata(q.shape, q.dtype, self.layer.isa, tables.seq_lens)
        out = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
            seq_lens=tables.seq_lens, scale=self.impl.scale, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=tables.block_table, softcap=0, scheduler_metadata=sched, s_aux=None,
            k_scale=self.layer._k_scale_float, v_scale=self.layer._v_scale_float, kv_cache_dtype="auto")
        return out


_SCHEDULE: list = [None, None]  # the last (key, scheduler metadata): a step's layers share their lengths


def _scheduler_metadata(q_shape: torch.Size, dtype: torch.dtype, isa: str, seq_lens: torch.Tensor) -> torch.Tensor:
    """vLLM's work split for ``q_shape[0]`` one-token pseudo-requests of ``q_shape[1]`` query heads
    and one KV head of lengths ``seq_lens``; reused while the next call asks the same."""
    key = (tuple(q_shape), dtype, isa, seq_lens.numpy().tobytes())
    if _SCHEDULE[0] != key:
        rows = q_shape[0]
        _SCHEDULE[:] = key, ops.cpu_attn_get_scheduler_metadata(
            num_reqs=rows, num_heads=q_shape[1], num_kv_heads=1, head_dim=q_shape[2], seq_lens=seq_lens.clone(),
            dtype=dtype, query_start_loc=torch.arange(rows + 1, dtype=torch.int32), causal=True,
            sliding_window_size=-1, isa=isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)
    return _SCHEDULE[1]


class KvsieveCPUAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with :class:`KvsieveCPUAttentionImpl` and :class:`KvsieveCPUMetadataBuilder`."""

    supported_kv_cache_dtypes = ["auto"]

    @staticmethod
    def get_impl_cls() -> type[KvsieveCPUAttentionImpl]:
        return KvsieveCPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KvsieveCPUMetadataBuilder]:
        return KvsieveCPUMetadataBuilder


RefuseMLABackend = refusing_backend(
    "RefuseMLABackend", "kvsieve vLLM plug-in: MLA attention (DeepSeek-style latent KV) is not supported by the "
    "plug-in on CPU; unset KVSIEVE_SELECTOR/KVSIEVE_CONFIG")
