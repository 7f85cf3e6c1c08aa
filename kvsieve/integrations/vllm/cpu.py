"""vLLM's CPU attention backend (``CPU_ATTN``) with kvsieve computing the attention.

:class:`KvsieveCPUAttentionBackend` keeps vLLM's cache shape, metadata builder and KV write
(``do_kv_cache_update``, run by vLLM before ``forward``); only ``forward`` changes: it views the
layer's cache (:mod:`.layouts`), translates the step (:class:`.step.StepTranslator`, once per
step) and runs the layer's selector, then the attention (:class:`.step.LayerRunner`: SDPA over a
block-wise gather for prompt rows the layer does not select, the kvsieve backend for the others).

Whatever a layer attends densely runs vLLM's own kernel on vLLM's own metadata (no gather): dense
layers whole, sliding-window layers whole (their selector, if any, is not run: Gemma 3's local
layers), and the dense rows of a selecting layer; a selection of whole vLLM blocks runs vLLM's paged
kernel on per-(row, KV head) block tables (:class:`VllmHostAttention`); any other selection of decode
rows (token-granular, smaller pages) runs kvsieve's native decode kernel on per-(row, KV head) runs
of vLLM's cache, read in place (:func:`.host.native_runs_attention`).

Refused when the layer is built, naming the feature: ALiBi, logit soft-capping, attention sinks,
KV sharing between layers, FP8 KV cache, encoder / cross attention; at ``forward``: non-causal
steps and fused output quantization. The builder keeps vLLM's KV write
in a layout kvsieve can view in each KV cache group holding a layer kvsieve reads: the ``amx`` ISA
(which packs K for AMX tiles) is replaced by ``vec`` there, and the layout is checked by writing known
values through vLLM's own op; a group of layers left whole to vLLM keeps vLLM's ISA.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

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
from .host import PerHeadTables
from .layer_checks import refuse_features, refusing_backend, worker_ranks
from .layouts import kv_views
from .request_settings import row_prompt_lens, row_settings
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
        layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names).values()
        self.reads_cache = state is None or any(
            _selecting_layer(layer) and not state.host_only(extract_layer_index(layer.layer_name)) for layer in layers)
        if self.reads_cache:
            if self.isa not in VIEWABLE_ISAS:
                self.isa = "vec" if self.block_size % 32 == 0 else "vec16"
                self._set_isa_to_layers(layer_names)
            probe_cpu_layout(self.isa, self.dtype, self.block_size, self.head_dim, self.num_kv_heads)

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False  # noqa: ANN001
              ) -> KvsieveCPUAttentionMetadata:
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        step = None
        if self.reads_cache:
            b = md.seq_lens.shape[0]
            step = VllmStep.from_tensors(md.query_start_loc, md.seq_lens, md.block_table, md.num_actual_tokens,
                                         settings=row_settings(b), prompt_lens=row_prompt_lens(b))
        return KvsieveCPUAttentionMetadata(**{f.name: getattr(md, f.name) for f in fields(md)}, step=step)


def probe_cpu_layout(isa: str, dtype: torch.dtype, block_size: int, head_dim: int, num_kv_heads: int) -> None:
    """Write known K/V with vLLM's own ``cpu_attn_reshape_and_cache`` into a scratch cache and read
    them back through :func:`.layouts.kv_views`; raise if the layout is not the one kvsieve views."""
    gen = torch.Generator().manual_seed(0)
    n = 2 * block_size
    k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    cache = torch.zeros(3, num_kv_heads, block_size, 2 * head_dim, dtype=dtype)
    half = cache.view(3, num_kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)
    slots = torch.arange(block_size, block_size + n, dtype=torch.int64)  # blocks 1 and 2
    ops.cpu_attn_reshape_and_cache(k, v, half[0], half[1], slots, isa)
    kv, vv = kv_views(LAYOUT, cache)
    pos = slots - block_size
    got_k, got_v = kv[1 + pos // block_size, :, pos % block_size], vv[1 + pos // block_size, :, pos % block_size]
    if not (torch.equal(got_k, k) and torch.equal(got_v, v)):
        raise NotImplementedError(f"kvsieve vLLM plug-in: vLLM's CPU KV write with ISA {isa!r} ({dtype}, block "
                                  f"{block_size}, head_dim {head_dim}) is not the {LAYOUT!r} layout kvsieve views")


class KvsieveCPUAttentionImpl(CPUAttentionBackendImpl):
    """``forward`` runs kvsieve over vLLM's cache; everything else is vLLM's."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None) -> None:
        # a sliding-window layer (Gemma 3's local layers) is vLLM's own attention, whole (forward)
        refuse_features(alibi_slopes=alibi_slopes, sliding_window=None, logits_soft_cap=logits_soft_cap,
                        attn_type=attn_type, kv_sharing_target_layer_name=kv_sharing_target_layer_name, sinks=sinks,
                        kv_cache_dtype=kv_cache_dtype)
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        self.state: PluginState = plugin_state(get_current_vllm_config(), device=torch.device("cpu"),
                                               ranks=worker_ranks())
        self.state.start_indexer_feed(_selecting_layer, lambda module: extract_layer_index(module.layer_name))
        self._layer_idx: int | None = None  # this layer's index, read from its name at the first forward

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,  # noqa: ANN001
                kv_cache: torch.Tensor, attn_metadata: KvsieveCPUAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None
                ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvsieve vLLM plug-in: fused output quantization (output_scale) is not supported")
        if attn_metadata is None:  # vLLM's warm-up/profiling pass
            return output
        if not attn_metadata.causal or attn_metadata.dynamic_causal is not None:
            raise NotImplementedError("kvsieve vLLM plug-in: non-causal attention steps are not supported")
        n = attn_metadata.num_actual_tokens
        if self._layer_idx is None:
            self._layer_idx = extract_layer_index(layer.layer_name)
        layer_idx = self._layer_idx
        if self.sliding_window != -1 or self.state.host_only(layer_idx):  # vLLM's own attention, nothing else
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        hidden = None
        if layer_idx in self.state.indexer_layers:  # DSA: the layer's hidden state, kept by its attention module
            hidden = self.state.feed.take(layer_idx, n, query.shape[0])
        step = getattr(attn_metadata, "step", None)  # None: metadata vLLM built without the plug-in's builder
        if step is None:
            b = attn_metadata.seq_lens.shape[0]
            step = VllmStep.from_tensors(attn_metadata.query_start_loc, attn_metadata.seq_lens,
                                         attn_metadata.block_table, n, settings=row_settings(b),
                                         prompt_lens=row_prompt_lens(b))
        one, setting = step.one_setting
        if step.decode_only and one:  # one native call (selection, tables, attention) where the selector has
            # a program and every row takes one setting (the process's, or one per-request budget)
            native = self.state.decode_path(layer_idx, LAYOUT, kv_cache, num_heads=self.num_heads,
                                            num_kv_heads=self.num_kv_heads, head_size=self.head_size,
                                            scale=self.scale, setting=setting)
            if native is not None:
                model_inputs = None if hidden is None else IndexerInputs(hidden=hidden)
                native.run(step.block_table, step.seq_lens, step.positions, query[:n],
                           output[:n].view(n, self.num_heads, self.head_size), model_inputs)
                if self.state.state_check is not None:  # debug: the pools the native call left, checked
                    self.state.check_decode_step(layer_idx, LAYOUT, kv_cache, query[:n], key[:n], value[:n], step,
                                                 model_inputs)
                return output
        host = VllmHostAttention(self, layer, query, key, value, kv_cache, attn_metadata)
        self.state.run_layer(
            layer_idx, LAYOUT, kv_cache, query[:n], key[:n], value[:n], output[:n], step=step,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_size=self.head_size, scale=self.scale,
            host=host, indexer_hidden=hidden)
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
