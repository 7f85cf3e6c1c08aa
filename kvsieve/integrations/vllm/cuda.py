"""vLLM's CUDA Triton attention backend (``TRITON_ATTN``) with kvsieve computing the attention
through its Triton kernels (kvsieve backend ``triton``: paged prefill + sparse GQA decode, reading
vLLM's block table through :class:`~kvsieve.metadata.ForeignPagedKV`): a thin adapter from vLLM's
objects to the plug-in's router (:mod:`.router`), as :mod:`.cpu` is, without host kernels.

**Never run on a GPU** (written against vLLM 0.32's ``triton_attn.py``; import-tested on CPU and
marked for GPU in tests/vllm). On CUDA the plug-in serves only ``TRITON_ATTN`` (start vLLM with
``--attention-backend TRITON_ATTN``); the other CUDA backends are overridden by classes that
refuse at start-up, so vLLM never runs its own attention silently while the plug-in is enabled.
CUDA graphs are refused (the step translation of prompt and mixed steps reads the step's tables on the
host): use ``--enforce-eager``. The one-call decode path is the fixed-shape device path
(:class:`~.native_decode.DeviceDecodeLayer`): vLLM's device block table and lengths, no host
synchronisation, no shape taken from a value — the part a captured decode graph would replay
(``tests/kernels/test_gpu_decode_layer.py`` captures and replays it where a GPU exists). A decode
step is told here by vLLM's ``max_query_len == 1``, without reading prompt lengths to the host, so a
prompt's one-token last chunk is selected there as a generation row. The same layer features as on
CPU are refused (:func:`.startup.refuse_layer_features`), and sliding windows too.
"""
from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl, TritonAttentionMetadata

from ...sparse import AttentionGeometry
from .request_settings import row_prompt_lens, row_settings
from .router import DUMMY_STEP, ONE_CALL_DECODE, refuse_step, route_call
from .startup import refuse_cuda_graphs, refuse_layer_features, refusing_backend, worker_ranks
from .state import PluginState, plugin_state
from .step import VllmStep

__all__ = ["KvsieveTritonAttentionBackend", "KvsieveTritonAttentionImpl", "RefuseOtherCudaBackend", "LAYOUT"]

LAYOUT = "vllm-triton"


class KvsieveTritonAttentionImpl(TritonAttentionImpl):
    """``forward`` runs kvsieve over vLLM's cache; everything else is vLLM's."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: AttentionType = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None,
                 use_alibi_sqrt: bool = False, chunk_lookback: int = -1) -> None:
        refuse_layer_features(alibi_slopes=alibi_slopes, sliding_window=sliding_window,
                              logits_soft_cap=logits_soft_cap, attn_type=attn_type,
                              kv_sharing_target_layer_name=kv_sharing_target_layer_name, sinks=sinks,
                              kv_cache_dtype=kv_cache_dtype, chunk_lookback=chunk_lookback)
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks, use_alibi_sqrt,
                         chunk_lookback)
        vllm_config = get_current_vllm_config()
        refuse_cuda_graphs(vllm_config)
        self.state: PluginState = plugin_state(vllm_config, device=torch.device("cuda", torch.cuda.current_device()),
                                               ranks=worker_ranks())
        self.geometry = AttentionGeometry(kind="gqa", num_q_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                          head_dim=self.head_size, sm_scale=self.scale)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,  # noqa: ANN001
                kv_cache: torch.Tensor, attn_metadata: TritonAttentionMetadata, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None
                ) -> torch.Tensor:
        md = attn_metadata
        refuse_step(quantized_output=output_scale is not None or output_block_scale is not None,
                    causal=None if md is None else not isinstance(md.causal, torch.Tensor) and bool(md.causal))
        layer_idx, state = extract_layer_index(layer.layer_name), self.state
        rows = None if md is None else md.seq_lens.shape[0]
        settings = None if md is None else row_settings(rows)
        # a decode step (every row one query token; prompt lengths not read, nothing read to the host)
        route = route_call(has_metadata=md is not None, host_whole=False,
                           decode_step=lambda: (md.max_query_len == 1, settings),
                           one_call=lambda setting: state.decode_path(layer_idx, LAYOUT, kv_cache, self.geometry,
                                                                      setting))
        if route.path == DUMMY_STEP:
            return output.fill_(0)
        if route.path == ONE_CALL_DECODE:
            lens = md.seq_lens
            route.one_call.run(md.block_table[:rows], lens, lens - 1, query[:rows],
                               output[:rows].view(rows, self.num_heads, self.head_size))
            return output
        n = md.num_actual_tokens
        step = VllmStep.from_tensors(md.query_start_loc, md.seq_lens, md.block_table, n,
                                     prompt_lens=row_prompt_lens(rows), settings=settings)
        state.run_layer(layer_idx, LAYOUT, kv_cache, query[:n], key[:n], value[:n], output[:n], step=step,
                        geometry=self.geometry)
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
