"""Every refusal the plug-in makes before it serves a step, in the order a user meets them (free of
vLLM imports; the callers hand in what vLLM says).

1. :func:`check_plugin_config`, in :func:`.plugin.register` (every vLLM process, before anything is
   built): the config read from the environment (:mod:`.config`: malformed values, unknown file
   keys, both variables, a setting given twice), the selector and its fields, what
   :func:`lower_plans` refuses, the debug state check's selector (:func:`.state_check.check_supported`);
   then :func:`refuse_platform` (neither vLLM's CPU nor its CUDA platform).
2. When vLLM picks the attention backend of a layer, configured by ``--additional-config`` (vLLM's
   config exists only then; :func:`.plugin.__getattr__`): the same :func:`check_plugin_config` on the
   ``kvsieve`` entry (:func:`.config.read_plugin_config`: a malformed entry, a key of the wrong
   type, ``selector`` and ``config`` both, a setting in the entry and its file, the entry beside any
   ``KVSIEVE_*`` variable; an unknown key is an unknown selector field).
3. When vLLM builds each attention layer: :func:`refuse_layer_features` (ALiBi, soft-capping, sinks,
   KV sharing, encoder / cross attention, a KV cache dtype other than the model's; sliding windows
   and chunked local attention on CUDA), :func:`refuse_cuda_graphs` (CUDA), then, for the first
   layer of the process, :func:`check_engine` (context parallelism, prompt embeddings),
   :func:`.draft_checks.check_speculation` (speculative decoding), :func:`lower_plans` at the model's layer count and tensor-parallel size, and
   :func:`check_indexer_model` (a compiled model, or projections of another hidden size, for a
   selector reading the indexer); the environment's config and the entry both present are refused
   here too (:func:`.state.plugin_state`), and the state logs what it serves in one line.
   vLLM's MLA backends on CPU and every CUDA backend but ``TRITON_ATTN`` are
   :func:`refusing_backend` classes: vLLM stops when it picks one.
4. When vLLM builds a KV cache group's metadata builder (CPU): :func:`probe_cpu_layout`, vLLM's own KV
   write checked against the layout kvsieve views.
5. On the first model forward (vLLM's profile run, or the first step): a selecting layer with no
   DSA projections (:func:`check_projections`, from :class:`.indexer_feed.IndexerFeed`).

Per step the adapters refuse what a step asks that no path computes (fused output quantization,
non-causal steps: :func:`.router.refuse_step`), and a step whose rows' prompt lengths are not known
(:func:`.request_settings.row_prompt_lens`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...selectors.dsa import DSASelector, IndexerInputs
from ...sparse import LayerPlan, lower_config
from .config import PluginConfig, WorkerRanks
from .layouts import kv_views
from .state_check import check_supported

__all__ = ["check_plugin_config", "lower_plans", "refuse_platform", "refuse_layer_features", "refuse_cuda_graphs",
           "check_engine", "check_indexer_model", "probe_cpu_layout", "check_projections", "refusing_backend", "worker_ranks"]

PREFIX = "kvsieve vLLM plug-in"


def check_plugin_config(config: PluginConfig, *, device: str) -> None:
    """Start-up check in every vLLM process: the selector exists, its fields are valid, it serves
    ``device`` and nothing in :func:`lower_plans` refuses it (before the model's layer count is known)."""
    sparse = config.sparse
    if sparse is None:
        if config.check_state:
            check_supported(None)
        return
    span = max([i + 1 if i >= 0 else -i for i in sparse.dense_layers] + [1])
    from ...sparse.backends import default_backend

    plans = lower_plans(config, num_layers=span, backend_name=config.backend or default_backend(device), device=device)
    if config.check_state:
        check_supported(next((p.selector for p in plans if p is not None), None))


def lower_plans(config: PluginConfig, *, num_layers: int, backend_name: str, device: str = "cpu",
                tensor_parallel_size: int = 1) -> list[LayerPlan | None]:
    """One plan per layer (``None`` = dense), refusing what vLLM's attention layer cannot serve:
    selectors that evict prompt tokens (vLLM's block manager owns the blocks and lengths),
    selectors that need per-step model inputs (``model_inputs_type``; vLLM hands the attention
    backend only q, k, v and the cache), kernel hints the chosen kvsieve backend does not implement,
    and, with ``tensor_parallel_size > 1`` (each worker holds a shard of every layer's heads),
    selectors that do not declare ``Capabilities(per_kv_head=True)``. Of per-step model inputs
    (``model_inputs_type``) the plug-in feeds only :class:`~kvsieve.selectors.dsa.IndexerInputs`
    (the layer's hidden state, :mod:`.indexer_feed`), on CPU; any other type is refused."""
    plans = lower_config(config.sparse, num_layers=num_layers, attention_kind="gqa", device=device)
    plan = next((p for p in plans if p is not None), None)
    if plan is None:
        return plans
    sel = plan.selector
    if sel.capabilities.evicts:
        raise ValueError(
            f"{PREFIX}: selector {sel.name!r} evicts prompt tokens (predict_kv), which vLLM's block "
            "manager cannot be told about (it owns the blocks and the sequence lengths); use a selection-only "
            "selector (streaming, oracle_topk, quest, block_select or a third-party one without evicts=True)")
    wanted = sel.model_inputs_type
    if wanted is not None and wanted is not IndexerInputs:
        raise ValueError(
            f"{PREFIX}: selector {sel.name!r} needs per-step model inputs "
            f"({wanted.__name__}, its model_inputs_type), which vLLM's attention backend never receives (only q, "
            "k, v and the cache); the plug-in feeds IndexerInputs (the layer's hidden state) alone")
    if wanted is IndexerInputs and getattr(sel.config, "projections", "") is None:
        raise ValueError(
            f"{PREFIX}: selector {sel.name!r} needs its indexer projections (config field 'projections': "
            "a file from kvsieve distill-indexer for this model); inside vLLM the plug-in feeds each layer's hidden "
            "state, which only the projections turn into index queries and keys")
    if wanted is IndexerInputs and device != "cpu":
        raise ValueError(
            f"{PREFIX}: selector {sel.name!r} reads the layer's hidden state (IndexerInputs), which the "
            f"plug-in feeds on vLLM's CPU platform only, not on {device!r}")
    if tensor_parallel_size > 1 and not sel.capabilities.per_kv_head:
        raise ValueError(
            f"{PREFIX}: selector {sel.name!r} cannot run under tensor parallelism (tensor_parallel_size="
            f"{tensor_parallel_size}): each worker holds only a shard of a layer's heads, and the selector does not "
            "declare Capabilities(per_kv_head=True) (a KV head's selection read from that head alone); run it with "
            "tensor_parallel_size=1")
    # the one built-in that only gives kernel hints; a third-party selector's thresholds are refused
    # by the backend's forward (every backend without skip-softmax raises on a factor > 0)
    if sel.name == "skip_softmax" and backend_name != "triton":
        raise ValueError(
            f"{PREFIX}: selector {sel.name!r} gives kernel hints (skip-softmax thresholds) that only "
            f"the 'triton' backend implements; the plug-in runs backend {backend_name!r}")
    return plans


def refuse_platform(config: PluginConfig, device_name: str) -> None:
    """The plug-in runs on vLLM's CPU and CUDA platforms only."""
    raise ValueError(f"{PREFIX} ({config.source}): platform {device_name!r} is not supported; it runs on vLLM's "
                     "CPU and CUDA platforms")


def refuse_layer_features(*, alibi_slopes: object, sliding_window: int | None, logits_soft_cap: float | None,
                          attn_type: str, kv_sharing_target_layer_name: str | None, sinks: object,
                          kv_cache_dtype: str, chunk_lookback: int = -1) -> None:
    """Raise ``NotImplementedError`` naming every layer feature the plug-in does not compute
    (``attn_type``: vLLM's ``AttentionType``, a ``str`` enum; ``sliding_window``: pass ``None``
    where the adapter leaves sliding-window layers whole to vLLM, as on CPU)."""
    refused = []
    if alibi_slopes is not None:
        refused.append("ALiBi position biases (alibi_slopes)")
    if sliding_window is not None:
        refused.append(f"sliding-window attention (window {sliding_window})")
    if logits_soft_cap:
        refused.append(f"logit soft-capping (logits_soft_cap={logits_soft_cap})")
    if sinks is not None:
        refused.append("attention sinks (learned per-head sink logits)")
    if kv_sharing_target_layer_name is not None:
        refused.append(f"KV sharing with layer {kv_sharing_target_layer_name!r}")
    if attn_type != "decoder":
        refused.append(f"attention type {getattr(attn_type, 'value', attn_type)!r} (only decoder self-attention)")
    if kv_cache_dtype != "auto":
        refused.append(f"KV cache dtype {kv_cache_dtype!r} (only the model dtype, 'auto')")
    if refused:
        raise NotImplementedError(f"{PREFIX}: this layer uses " + "; ".join(refused) +
                                  ", which the plug-in does not compute; unset KVSIEVE_SELECTOR/KVSIEVE_CONFIG "
                                  "(or the additional config's 'kvsieve' entry) to run vLLM's own attention")
    if chunk_lookback != -1:
        raise NotImplementedError(f"{PREFIX}: chunked local attention (chunk_lookback={chunk_lookback}) is not "
                                  "supported")


def refuse_cuda_graphs(vllm_config: object) -> None:
    """CUDA graphs: the step translation of prompt and mixed steps reads the step's tables on the host."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    if mode is not None and getattr(mode, "name", str(mode)) != "NONE":
        raise NotImplementedError(f"{PREFIX}: CUDA graphs (cudagraph_mode={mode}) are not supported; "
                                  "start vLLM with --enforce-eager")


def check_engine(vllm_config: Any) -> None:
    """The engine-wide refusals, when the first plug-in layer is built (``vllm_config`` read through
    plain attributes: ``parallel_config.decode_context_parallel_size`` / ``prefill_context_parallel_size``,
    ``model_config.enable_prompt_embeds``; speculative decoding: :func:`.draft_checks.check_speculation`)."""
    parallel = vllm_config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel, name) > 1:
            raise NotImplementedError(
                f"{PREFIX}: {name}={getattr(parallel, name)} is not supported: context parallelism "
                "spreads one request's tokens over several workers' caches, and a selector here sees one "
                "worker's cache only; use tensor or pipeline parallelism")
    if getattr(vllm_config.model_config, "enable_prompt_embeds", False):
        raise NotImplementedError(
            f"{PREFIX}: enable_prompt_embeds is not supported: a prompt given as embeddings reaches "
            "the workers without token ids, so the plug-in cannot tell its prompt from the tokens it generated "
            "when vLLM computes it again after a preemption (docs/vllm.md, preemption)")


def check_indexer_model(vllm_config: Any, plans: list[LayerPlan | None]) -> None:
    """For a selector reading the indexer (``plans``: the process's, :func:`lower_plans`): the model
    runs eagerly (``compilation_config.mode`` 0) and its ``model_config.hf_config.hidden_size`` is the
    DSA projections'."""
    reading = [p for p in plans if p is not None and p.selector.model_inputs_type is IndexerInputs]
    if not reading:
        return
    sel = reading[0].selector
    mode = int(vllm_config.compilation_config.mode)
    if mode != 0:
        raise NotImplementedError(
            f"{PREFIX}: selector {sel.name!r} reads each layer's hidden state from the model's "
            f"attention modules, which is right only when the model runs eagerly; compilation mode {mode} "
            "traces it (run with enforce_eager=True / --enforce-eager; pipeline parallelism on CPU needs a "
            "traced model, so it cannot serve this selector)")
    hidden = int(vllm_config.model_config.hf_config.hidden_size)
    if isinstance(sel, DSASelector):
        sizes = {i: p.hidden_size for i, p in sel.projections.items() if p.hidden_size != hidden}
        if sizes:
            raise ValueError(f"{PREFIX}: dsa projections of layers {sorted(sizes)} take hidden "
                             f"size {sorted(set(sizes.values()))}, the model's is {hidden} (projections "
                             "distilled for another model?)")


def probe_cpu_layout(write: Callable[..., None], isa: str, dtype: torch.dtype, block_size: int, head_dim: int,
                     num_kv_heads: int, layout: str = "vllm-cpu") -> None:
    """Write known K/V with vLLM's own KV write ``write`` (``cpu_attn_reshape_and_cache(k, v,
    key_cache, value_cache, slots, isa)``) into a scratch cache and read them back through
    :func:`.layouts.kv_views`; raise if the layout is not the one kvsieve views."""
    gen = torch.Generator().manual_seed(0)
    n = 2 * block_size
    k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    cache = torch.zeros(3, num_kv_heads, block_size, 2 * head_dim, dtype=dtype)
    half = cache.view(3, num_kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)
    slots = torch.arange(block_size, block_size + n, dtype=torch.int64)  # blocks 1 and 2
    write(k, v, half[0], half[1], slots, isa)
    kv, vv = kv_views(layout, cache)
    pos = slots - block_size
    got_k, got_v = kv[1 + pos // block_size, :, pos % block_size], vv[1 + pos // block_size, :, pos % block_size]
    if not (torch.equal(got_k, k) and torch.equal(got_v, v)):
        raise NotImplementedError(f"{PREFIX}: vLLM's CPU KV write with ISA {isa!r} ({dtype}, block "
                                  f"{block_size}, head_dim {head_dim}) is not the {layout!r} layout kvsieve views")


def check_projections(plans: list[LayerPlan | None], layers: frozenset[int]) -> None:
    """The indexer feed found the selecting layers' modules: each must have its DSA projections."""
    sel = next(p.selector for p in plans if p is not None)
    missing = sorted(i for i in layers if isinstance(sel, DSASelector) and i not in sel.projections)
    if missing:
        raise ValueError(f"{PREFIX}: dsa has no indexer projections for layers {missing} (config "
                         "'projections': a file from kvsieve distill-indexer for this model; or list those "
                         "layers in dense_layers)")


def refusing_backend(name: str, message: str) -> type:
    """A stand-in backend class whose every attribute raises ``NotImplementedError(message)``:
    registered over vLLM backends the plug-in does not serve, so vLLM stops when it picks one."""

    class _Refused(type):
        def __getattr__(cls, attr: str) -> object:
            raise NotImplementedError(message)

    return _Refused(name, (), {"__doc__": f"Refuses: {message}", "__module__": __name__})


def worker_ranks() -> WorkerRanks:
    """This process's tensor-parallel rank and pipeline stage, from vLLM's parallel state (set up
    before vLLM builds any layer; imported here, in a vLLM process only)."""
    from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    pp = get_pp_group()
    return WorkerRanks(tp_rank=get_tensor_model_parallel_rank(), tp_size=get_tensor_model_parallel_world_size(),
                       pp_rank=pp.rank_in_group, pp_size=pp.world_size)
