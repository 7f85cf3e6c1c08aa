"""What an attention layer may ask of the plug-in: every feature it does not compute is refused
when vLLM builds the layer, by name; and which parallel worker builds it (shared by the CPU and
CUDA backends)."""
from __future__ import annotations

from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.v1.attention.backend import AttentionType

from .config import WorkerRanks

__all__ = ["refuse_features", "refusing_backend", "worker_ranks"]


def worker_ranks() -> WorkerRanks:
    """This process's tensor-parallel rank and pipeline stage, from vLLM's parallel state (set up
    before vLLM builds any layer)."""
    pp = get_pp_group()
    return WorkerRanks(tp_rank=get_tensor_model_parallel_rank(), tp_size=get_tensor_model_parallel_world_size(),
                       pp_rank=pp.rank_in_group, pp_size=pp.world_size)


def refuse_features(*, alibi_slopes: object, sliding_window: int | None, logits_soft_cap: float | None,
                    attn_type: str, kv_sharing_target_layer_name: str | None, sinks: object,
                    kv_cache_dtype: str) -> None:
    """Raise ``NotImplementedError`` naming every layer feature the plug-in does not compute."""
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
    if attn_type != AttentionType.DECODER:
        refused.append(f"attention type {getattr(attn_type, 'value', attn_type)!r} (only decoder self-attention)")
    if kv_cache_dtype != "auto":
        refused.append(f"KV cache dtype {kv_cache_dtype!r} (only the model dtype, 'auto')")
    if refused:
        raise NotImplementedError("kvsieve vLLM plug-in: this layer uses " + "; ".join(refused) +
                                  ", which the plug-in does not compute; unset KVSIEVE_SELECTOR/KVSIEVE_CONFIG "
                                  "to run vLLM's own attention")


def refusing_backend(name: str, message: str) -> type:
    """A stand-in backend class whose every attribute raises ``NotImplementedError(message)``:
    registered over vLLM backends the plug-in does not serve, so vLLM stops when it picks one."""

    class _Refused(type):
        def __getattr__(cls, attr: str) -> object:
            raise NotImplementedError(message)

    return _Refused(name, (), {"__doc__": f"Refuses: {message}", "__module__": __name__})
