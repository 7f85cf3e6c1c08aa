"""The ``vllm.general_plugins`` entry point. vLLM calls :func:`register` in every process it
starts (API server, engine core, workers). It imports nothing at module level (vLLM logs and
skips a plug-in that fails to *import*, which would silently leave vLLM's own attention in place),
and raises from :func:`register` on any bad setting (:func:`.startup.check_plugin_config`), which
stops vLLM at start-up."""
from __future__ import annotations

__all__ = ["register", "CPU_BACKEND", "CUDA_BACKEND"]

CPU_BACKEND = "kvsieve.integrations.vllm.cpu.KvsieveCPUAttentionBackend"
CUDA_BACKEND = "kvsieve.integrations.vllm.cuda.KvsieveTritonAttentionBackend"
# on CUDA every other attention backend is replaced by one that refuses at start-up
_CUDA_KEPT = ("TRITON_ATTN", "NO_ATTENTION", "CUSTOM", "CPU_ATTN", "CPU_MLA", "AMX_MLA")


def register() -> None:
    """Override vLLM's attention backend when ``KVSIEVE_SELECTOR`` or ``KVSIEVE_CONFIG`` is set."""
    from .config import read_plugin_config
    from .startup import check_plugin_config, refuse_platform

    config = read_plugin_config()
    if config is None:
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cpu():
        check_plugin_config(config, device="cpu")
        register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND)
        for mla in ("CPU_MLA", "AMX_MLA"):  # MLA models: refused when their layers are built
            register_backend(AttentionBackendEnum[mla], "kvsieve.integrations.vllm.cpu.RefuseMLABackend")
    elif current_platform.is_cuda():  # never run on a GPU (docs/vllm.md)
        check_plugin_config(config, device="cuda")
        for backend in AttentionBackendEnum:
            if backend.name not in _CUDA_KEPT:
                register_backend(backend, "kvsieve.integrations.vllm.cuda.RefuseOtherCudaBackend")
        register_backend(AttentionBackendEnum.TRITON_ATTN, CUDA_BACKEND)
    else:
        refuse_platform(config, current_platform.device_name)
