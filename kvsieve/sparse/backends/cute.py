"""CuTe-DSL backend for SM90 (wgmma) and SM100 (tcgen05) GPUs.

* MLA (absorbed, kv_lora_rank 512 + rope 64, bf16 latent cache) sparse tokens ->
  ``kernels.cute.sparse_mla_decode``;
* GQA sparse generation tokens (bf16, head_dim multiple of 64) -> ``kernels.cute.sparse_gqa_decode``.

What the CuTe kernels do not cover (context/prefill tokens, dense layers, skip-softmax) runs on
the Triton kernels and is recorded in :attr:`last_paths` (``"triton:<path>"``), never silently.
The backend refuses to run on anything but an SM90/SM100 CUDA device and names the backend to
use instead.
"""
from __future__ import annotations

import torch

from ...kernels.cute._common import cute_available, detect_arch
from ...metadata import AttentionMetadata
from ..params import SparseRuntimeParams
from .base import AttentionBackend, AttentionGeometry
from .triton_backend import TritonBackend, _token_slice

__all__ = ["CuteBackend"]


class CuteBackend(AttentionBackend):
    name = "cute"
    kv_page_granular = False
    devices = frozenset({"cuda"})

    def __init__(self) -> None:
        self.last_paths: dict[str, str] = {}
        self._triton = TritonBackend()

    @staticmethod
    def check_device(device: torch.device) -> str:
        """``"sm90"``/``"sm100"``, else ValueError saying which backend to use instead."""
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ValueError(f"the cute backend runs only on NVIDIA SM90 (Hopper) or SM100 "
                             f"(Blackwell) GPUs, got device {device}; use backend 'vanilla' "
                             f"(or 'torch') on CPU")
        arch = detect_arch(device)
        if arch is None:
            cc = torch.cuda.get_device_capability(device)
            raise ValueError(f"the cute backend is built for sm_90a and sm_100a, got compute "
                             f"capability {cc[0]}.{cc[1]}; use backend 'triton'")
        ok, why = cute_available()
        if not ok:
            raise ValueError(f"the cute backend needs nvidia-cutlass-dsl ({why}); install "
                             f"kvsieve[cute] or use backend 'triton'")
        return arch

    def forward(self, q: torch.Tensor, metadata: AttentionMetadata, layer_idx: int,
                geometry: AttentionGeometry, params: SparseRuntimeParams | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        from ...kernels.cute.sparse_gqa_decode import sparse_gqa_decode
        from ...kernels.cute.sparse_mla_decode import sparse_mla_decode

        self.check_device(q.device)
        mgr = metadata.kv_cache_manager
        table, tok_req, lens = metadata.block_table, metadata.token_to_req, metadata.token_kv_lens
        n_tok, n_ctx = q.shape[0], metadata.num_ctx_tokens
        sparse = params is not None and params.sparse_attn_indices is not None
        skip = params is not None and (params.threshold_scale_factor > 0
                                       or params.decode_threshold > 0)
        self.last_paths = {}
        if not sparse or skip or q.dtype != torch.bfloat16 or (
                geometry.kind == "mla" and (geometry.kv_lora_rank != 512
                                            or geometry.head_dim != 576)):
            out = self._triton.forward(q, metadata, layer_idx, geometry, params)
            self.last_paths = {k: f"triton:{v}" for k, v in self._triton.last_paths.items()}
            return out
        bs = params.sparse_attn_indices_block_size
        if geometry.kind == "mla":
            idx, off = _token_slice(params, 0, n_tok)
            if bs != 1:
                raise ValueError("the cute MLA kernel takes token-level selections "
                                 "(sparse_attn_indices_block_size == 1)")
            out, lse = sparse_mla_decode(q, mgr.latent_cache(layer_idx), table, tok_req, lens,
                                         idx, off, geometry.kv_lora_rank, geometry.sm_scale)
            self.last_paths["all"] = "cute:mla_gather"
            return out, lse
        out = torch.empty(n_tok, geometry.num_q_heads, geometry.value_dim, dtype=q.dtype,
                          device=q.device)
        lse = torch.empty(n_tok, geometry.num_q_heads, dtype=torch.float32, device=q.device)
        if n_ctx:
            idx, off = _token_slice(params, 0, n_ctx)
            from ...kernels.triton import paged_prefill, select_prefill_path
            o, l = paged_prefill(q[:n_ctx], mgr.k_cache(layer_idx), mgr.v_cache(layer_idx), table,
                                 tok_req[:n_ctx], lens[:n_ctx], idx, off, bs, geometry.sm_scale)
            out[:n_ctx], lse[:n_ctx] = o, l
            self.last_paths["context"] = f"triton:{select_prefill_path(idx)}"
        if n_tok > n_ctx:
            idx, off = _token_slice(params, n_ctx, n_tok)
            o, l = sparse_gqa_decode(q[n_ctx:], mgr.k_cache(layer_idx), mgr.v_cache(layer_idx),
                                     table, tok_req[n_ctx:], lens[n_ctx:], idx, off, bs,
                                     geometry.sm_scale)
            out[n_ctx:], lse[n_ctx:] = o, l
            self.last_paths["generation"] = "cute:gqa_block_gather"
        return out, lse
