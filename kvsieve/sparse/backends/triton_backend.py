"""The portable fast path: routes each phase of a step to the Triton paged kernels.

* GQA context rows -> ``paged_prefill`` (dense query tiles, or per-token sparse gather);
* GQA generation rows -> ``sparse_gqa_decode`` (group-packed gather, split-K + LSE merge);
* MLA (absorbed) rows -> ``sparse_mla_decode``.

GQA kernels address the pool through TensorRT-LLM's 4-D block offsets (the ``block_offsets``
translation: K of block ``b`` at half-block ``2*b``, V at ``2*b + 1``); the MLA latent pool has no
K/V halves and is addressed through the block table. Each phase reads its own
:meth:`SparseRuntimeParams.selects_positions` and :meth:`SparseRuntimeParams.threshold_scale_factor`;
the result carries the paths taken and the skip-softmax tile counters. On CPU the kernels run
only under the Triton interpreter (``TRITON_INTERPRET=1`` set before kvsieve is imported).
"""
from __future__ import annotations

import os

import torch

from ...kernels.paged_prefill.plan import select_prefill_path
from ...kernels.paged_prefill.triton import paged_prefill
from ...kernels.sparse_gqa_decode.triton import sparse_gqa_decode
from ...kernels.sparse_mla_decode.triton import sparse_mla_decode
from ...metadata import AttentionMetadata, half_block_views
from ..params import SparseRuntimeParams
from ..selection import unique_sorted_segments
from .base import AttentionBackend, AttentionGeometry, AttentionResult, BackendCapabilities, register_backend

__all__ = ["TritonBackend", "phase_selection"]


def phase_selection(params: SparseRuntimeParams | None, phase: str, rows: slice
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, int, float]:
    """What the kernels take for the rows ``rows`` of ``phase``: indices (each segment as a set,
    :func:`unique_sorted_segments`), re-based offsets (both ``None`` when the phase is not
    selected), the block size and the skip-softmax factor."""
    if params is None:
        return None, None, 1, 0.0
    factor = params.threshold_scale_factor(phase)
    if not params.selects_positions(phase):
        return None, None, 1, factor
    off = params.sparse_attn_offsets
    lo, hi = int(off[rows.start]), int(off[rows.stop])
    local = (off[rows.start: rows.stop + 1] - lo).to(torch.int32)
    return (unique_sorted_segments(params.sparse_attn_indices[:, lo:hi], local), local,
            params.sparse_attn_indices_block_size, factor)


def check_triton_device(q: torch.Tensor) -> None:
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton backend needs CUDA tensors, or TRITON_INTERPRET=1 set before kvsieve "
                         "is imported to run its kernels on CPU; on CPU use backend 'torch'")


@register_backend
class TritonBackend(AttentionBackend):
    name = "triton"
    kv_page_granular = True
    required_translations = ("block_offsets",)

    def __init__(self) -> None:
        # CPU tensors only under the Triton interpreter (read when the kernels are imported)
        devices = frozenset({"cuda", "cpu"} if os.environ.get("TRITON_INTERPRET") == "1" else {"cuda"})
        self.capabilities = BackendCapabilities(devices=devices, skip_softmax_devices=devices)

    def forward(self, q: torch.Tensor, metadata: AttentionMetadata, layer_idx: int, geometry: AttentionGeometry,
                params: SparseRuntimeParams | None) -> AttentionResult:
        check_triton_device(q)
        metadata.require(f"backend {self.name!r}", self.required_translations)
        stats = torch.zeros(2, dtype=torch.int64, device=q.device)
        out = torch.empty(q.shape[0], geometry.num_q_heads, geometry.value_dim, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[0], geometry.num_q_heads, dtype=torch.float32, device=q.device)
        paths = {}
        for phase in metadata.phases():
            rows = metadata.phase_rows(phase)
            out[rows], lse[rows], paths[phase] = self.run_phase(q, metadata, layer_idx, geometry, params, phase, stats)
        skipped, walked = (int(x) for x in stats.tolist())
        return AttentionResult(out, lse, self.effective_attended_tokens(params, metadata, geometry), paths,
                               skipped, walked)

    def run_phase(self, q: torch.Tensor, metadata: AttentionMetadata, layer_idx: int, geometry: AttentionGeometry,
                  params: SparseRuntimeParams | None, phase: str, stats: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, str]:
        """``(out, lse, path)`` of the rows of ``phase``; adds skip-softmax tile counts to ``stats`` when the
        phase has a skip-softmax factor."""
        mgr = metadata.kv_cache_manager
        rows = metadata.phase_rows(phase)
        tok_req, lens = metadata.token_to_req[rows], metadata.token_kv_lens[rows]
        idx, off, bs, factor = phase_selection(params, phase, rows)
        stats = stats if factor > 0 else None  # the counters cover skip-softmax phases only (0 / 0 when off)
        if geometry.kind == "mla":
            o, l = sparse_mla_decode(q[rows], mgr.latent_cache(layer_idx), metadata.block_table, tok_req, lens, idx,
                                     off, geometry.kv_lora_rank, geometry.sm_scale, factor, stats,
                                     block_size=bs)
            return o, l, "mla_gather"
        k_cache, v_cache = half_block_views(mgr.k_cache(layer_idx), mgr.v_cache(layer_idx))
        kernel = paged_prefill if phase == "context" else sparse_gqa_decode
        o, l = kernel(q[rows], k_cache, v_cache, metadata.block_offset_table.k_offsets, tok_req, lens, idx, off, bs,
                      geometry.sm_scale, factor, stats)
        return o, l, select_prefill_path(idx) if phase == "context" else "decode_gather"
