"""CuTe-DSL backend for SM90 (wgmma) and SM100 (tcgen05) GPUs.

* MLA (absorbed, kv_lora_rank 512 + rope 64, bf16 latent cache) sparse tokens ->
  ``kernels.sparse_mla_decode.cute``;
* GQA sparse generation tokens (bf16, head_dim multiple of 64) -> ``kernels.sparse_gqa_decode.cute``.

What the CuTe kernels do not cover (context/prefill tokens, dense phases, skip-softmax) runs on
the Triton kernels; the result's ``paths`` name it (``"triton:<path>"``) and carry the Triton
statistics, never silently.
The backend refuses to run on anything but an SM90/SM100 CUDA device and names the backend to
use instead.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ...kernels.common.cute import cute_available, detect_arch
from ...metadata import AttentionMetadata
from ..params import SparseRuntimeParams
from .base import AttentionBackend, AttentionGeometry, AttentionResult, BackendCapabilities, register_backend
from .triton_backend import TritonBackend, phase_selection

__all__ = ["CuteBackend"]


@register_backend
class CuteBackend(AttentionBackend):
    name = "cute"
    kv_page_granular = False
    required_translations = TritonBackend.required_translations
    # skip-softmax and what the CuTe kernels do not cover run on the Triton kernels
    capabilities = BackendCapabilities(devices=frozenset({"cuda"}), skip_softmax_devices=frozenset({"cuda"}))

    def __init__(self) -> None:
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
                geometry: AttentionGeometry, params: SparseRuntimeParams | None) -> AttentionResult:
        from ...kernels.sparse_gqa_decode.cute import sparse_gqa_decode
        from ...kernels.sparse_mla_decode.cute import sparse_mla_decode

        self.check_device(q.device)
        phases = metadata.phases()
        skip = any(params is not None and params.threshold_scale_factor(p) > 0 for p in phases)
        covered = params is not None and not skip and q.dtype == torch.bfloat16
        if geometry.kind == "mla":
            covered = covered and geometry.kv_lora_rank == 512 and geometry.head_dim == 576 and all(
                params.selects_positions(p) for p in phases)
        else:
            covered = covered and params.selects_positions("generation") and "generation" in phases
        if not covered:
            res = self._triton.forward(q, metadata, layer_idx, geometry, params)
            return replace(res, paths={k: f"triton:{v}" for k, v in res.paths.items()})
        mgr = metadata.kv_cache_manager
        table, tok_req, lens = metadata.block_table, metadata.token_to_req, metadata.token_kv_lens
        out = torch.empty(q.shape[0], geometry.num_q_heads, geometry.value_dim, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[0], geometry.num_q_heads, dtype=torch.float32, device=q.device)
        paths = {}
        for phase in phases:
            rows = metadata.phase_rows(phase)
            idx, off, bs, _ = phase_selection(params, phase, rows)
            if geometry.kind == "mla":
                if bs != 1:
                    raise ValueError("the cute MLA kernel takes token-level selections "
                                     "(sparse_attn_indices_block_size == 1)")
                o, l = sparse_mla_decode(q[rows], mgr.latent_cache(layer_idx), table, tok_req[rows], lens[rows],
                                         idx, off, geometry.kv_lora_rank, geometry.sm_scale)
                paths[phase] = "cute:mla_gather"
            elif phase == "context":
                o, l, path = self._triton.run_phase(q, metadata, layer_idx, geometry, params, phase)
                paths[phase] = f"triton:{path}"
            else:
                o, l = sparse_gqa_decode(q[rows], mgr.k_cache(layer_idx), mgr.v_cache(layer_idx), table,
                                         tok_req[rows], lens[rows], idx, off, bs, geometry.sm_scale)
                paths[phase] = "cute:gqa_block_gather"
            out[rows], lse[rows] = o, l
        attended = self.effective_attended_tokens(params, metadata, geometry)
        if paths.get("context", "").startswith("triton:"):  # page-gathering rows count whole pages
            ctx = metadata.context_rows
            attended[ctx] = self._triton.effective_attended_tokens(params, metadata, geometry)[ctx]
        return AttentionResult(out, lse, attended, paths)
