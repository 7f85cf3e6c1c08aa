"""vLLM's CUDA Triton attention backend (``TRITON_ATTN``) with kvsieve computing the attention
through its Triton kernels (kvsieve backend ``triton``: paged prefill + sparse GQA decode, reading
vLLM's block table through :class:`~kvsieve.metadata.ForeignPagedKV`).

**Never run on a GPU** (written against vLLM 0.32's ``triton_attn.py``; import-tested on CPU and
marked for GPU in tests/vllm). On CUDA the plug-in serves only ``TRITON_ATTN`` (start vLLM with
``--attention-backend TRITON_ATTN``); the other CUDA backends are overridden by classes that
refuse at start-up, so vLLM never runs its own attention silently while the plug-in is enabled.
CUDA graphs are refused (the step translation of prompt and mixed steps reads the step's tables on the
host): use ``--enforce-eager``. Decode steps of a selector with a decode program take the fixed-shape
device path (:class:`~.native_decode.DeviceDecodeLayer`): vLLM's device block table and lengths, no
host synchronisation, no shape taken from a value — the part a captured decode graph would replay
(``tests/kernels/test_gpu_decode_layer.py`` captures and replays it where a GPU exists). The same layer features as on CPU are refused (:mod:`.layer_checks`).
"""
from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl, TritonAttentionMetadata

from .layer_checks import refuse_features, refusing_backend, worker_ranks
from .request_settings import row_prompt_lens, row_settings
from .state import PluginState, plugin_state
from .step import VllmStep

__all__ = ["KvsieveTritonAttentionBackend", "KvsieveTritonAttentionImpl", "RefuseOtherCudaBackend", "LAYOUT"]

LAYOUT = "vllm-triton"


def refuse_cuda_graphs(vllm_config: object) -> None:
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    if mode is not None and getattr(mode, "name", str(mode)) != "NONE":
        raise NotImplementedError(f"kvsieve vLLM plug-in: CUDA graphs (cudagraph_mode={mode}) are not supported; "
                                  "start vLLM with --enforce-eager")


class KvsieveTritonAttentionImpl(TritonAttentionImpl):
    """``forward`` runs kvsieve over vLLM's cache; everything else is vLLM's."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: AttentionType = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None,
                 use_alibi_sqrt: bool = False, chunk_lookback: int = -1) -> None:
        refuse_features(alibi_slopes=alibi_slopes, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                        attn_type=attn_type, kv_sharing_target_layer_name=kv_sharing_target_layer_name, sinks=sinks,
                        kv_cache_dtype=kv_cache_dtype)
        if chunk_lookback != -1:
            raise NotImplementedError(f"kvsieve vLLM plug-in: chunked local attention (chunk_lookback="
                                      f"{chunk_lookback}) is not supported")
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks, use_alibi_sqrt,
                         chunk_lookback)
        vllm_config = get_current_vllm_config()
        refuse_cuda_graphs(vllm_config)
        self.state: PluginState = plugin_state(vllm_config, device=torch.device("cuda", torch.cuda.current_device()),
                                               ranks=worker_ranks())

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,  # noqa: ANN001
                kv_cache: torch.Tensor, attn_metadata: TritonAttentionMetadata, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None
                ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvsieve vLLM plug-in: fused output quantization (output_scale) is not supported")
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        if isinstance(attn_metadata.causal, torch.Tensor) or not attn_metadata.causal:
            raise NotImplementedError("kvsieve vLLM plug-in: non-causal attention steps are not supported")
        n = attn_metadata.num_actual_tokens
        layer_idx = extract_layer_index(layer.layer_name)
        rows = attn_metadata.seq_lens.shape[0]
        settings = row_settings(rows)
        # a decode step whose rows take the process's setting: one fixed-shape device call, nothing read to the host
        if attn_metadata.max_query_len == 1 and settings is None:
            path = self.state.decode_path(layer_idx, LAYOUT, kv_cache, num_heads=self.num_heads,
                                          num_kv_heads=self.num_kv_heads, head_size=self.head_size, scale=self.scale)
            if path is not None:
                lens = attn_metadata.seq_lens
                b = lens.shape[0]
                path.run(attn_metadata.block_table[:b], lens, lens - 1, query[:b],
                         output[:b].view(b, self.num_heads, self.head_size))
                return output
        self.state.run_layer(
            layer_idx, LAYOUT, kv_cache, query[:n], key[:n], value[:n], output[:n],
            step=VllmStep.from_tensors(attn_metadata.query_start_loc, attn_metadata.seq_lens,
                                       attn_metadata.block_table, n, settings=settings,
                                       prompt_lens=row_prompt_lens(rows)),
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_size=self.head_size, scale=self.scale)
        return output


class KvsieveTritonAttentionBackend(TritonAttentionBackend):
    """``TRITON_ATTN`` with :class:`KvsieveTritonAttentionImpl`; only the model dtype as KV dtype."""

    supported_kv_cache_dtypes = ["auto"]

    @staticmethod
    def get_impl_cls() -> type[KvsieveTritonAttentionImpl]:
        return KvsieveTritonAttentionImpl


RefuseOtherCudaBackend = refusing_backend(
    "RefuseOtherCudaBackend", "kvsieve vLLM plug-in: on CUDA the plug-in serves only the TRITON_ATTN backend; start "
    "vLLM with --attention-backend TRITON_ATTN (and --enforce-eager)")
