"""The ``vllm.general_plugins`` entry point. vLLM calls :func:`register` in every process it
starts (API server, engine core, workers). It imports nothing at module level (vLLM logs and
skips a plug-in that fails to *import*, which would silently leave vLLM's own attention in place),
and raises from :func:`register` on any bad setting in the environment
(:func:`.startup.check_plugin_config`), which stops vLLM at start-up.

vLLM calls :func:`register` before it has built its config, so a plug-in configured by
``--additional-config`` (its ``kvsieve`` entry, :mod:`.config`) is decided later: without the
environment's settings, :func:`register` points each backend it would replace at a name of this
module, which resolves (:func:`__getattr__`) when vLLM picks the backend for a layer, with vLLM's
config current: kvsieve's class when the entry is there (checked first, as the environment's is
in :func:`register`), vLLM's own class otherwise."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["register", "CPU_BACKEND", "CUDA_BACKEND"]

CPU_BACKEND = "kvsieve.integrations.vllm.cpu.KvsieveCPUAttentionBackend"
CUDA_BACKEND = "kvsieve.integrations.vllm.cuda.KvsieveTritonAttentionBackend"
_REFUSE_MLA = "kvsieve.integrations.vllm.cpu.RefuseMLABackend"
_REFUSE_CUDA = "kvsieve.integrations.vllm.cuda.RefuseOtherCudaBackend"
# on CUDA every other attention backend is replaced by one that refuses at start-up
_CUDA_KEPT = ("TRITON_ATTN", "NO_ATTENTION", "CUSTOM", "CPU_ATTN", "CPU_MLA", "AMX_MLA")


@dataclass(frozen=True)
class _Deferred:
    """The backends :func:`register` left to the engine's config: vLLM backend name -> kvsieve's class path."""

    device: str
    routes: dict[str, str]


_DEFERRED: _Deferred | None = None


def register() -> None:
    """Override vLLM's attention backend when ``KVSIEVE_SELECTOR`` or ``KVSIEVE_CONFIG`` is set;
    otherwise leave the choice to ``--additional-config`` (module docstring)."""
    global _DEFERRED
    from .config import read_plugin_config
    from .startup import check_plugin_config, refuse_platform

    config = read_plugin_config()
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cpu():
        device = "cpu"
        # MLA models: refused when their layers are built
        routes = {"CPU_ATTN": CPU_BACKEND, "CPU_MLA": _REFUSE_MLA, "AMX_MLA": _REFUSE_MLA}
    elif current_platform.is_cuda():  # never run on a GPU (docs/vllm.md)
        device = "cuda"
        routes = {b.name: _REFUSE_CUDA for b in AttentionBackendEnum if b.name not in _CUDA_KEPT}
        routes["TRITON_ATTN"] = CUDA_BACKEND
    elif config is not None:
        refuse_platform(config, current_platform.device_name)
        return
    else:
        return
    if config is not None:
        check_plugin_config(config, device=device)
    else:
        _DEFERRED = _Deferred(device, routes)
    for name, path in routes.items():
        register_backend(AttentionBackendEnum[name], path if config is not None else f"{__name__}.{name}")


def __getattr__(name: str) -> type:
    """A backend :func:`register` deferred: kvsieve's class when the current vLLM config carries the
    ``kvsieve`` entry (checked by :func:`.startup.check_plugin_config` first), else vLLM's own."""
    if _DEFERRED is None or name not in _DEFERRED.routes:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from vllm.config import get_current_vllm_config_or_none
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from .config import read_plugin_config
    from .startup import check_plugin_config

    vllm_config = get_current_vllm_config_or_none()
    config = read_plugin_config(additional=getattr(vllm_config, "additional_config", None))
    if config is None:
        return resolve_obj_by_qualname(AttentionBackendEnum[name].value)
    check_plugin_config(config, device=_DEFERRED.device)
    return resolve_obj_by_qualname(_DEFERRED.routes[name])
