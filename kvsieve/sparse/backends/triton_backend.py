"""The portable fast path: routes each step to the Triton paged kernels.

* GQA context tokens -> ``paged_prefill`` (dense query tiles, or per-token sparse gather);
* GQA generation tokens -> ``sparse_gqa_decode`` (group-packed gather, split-K + LSE merge);
* MLA (absorbed) tokens -> ``sparse_mla_decode``.

Skip-softmax: context tokens use ``params.threshold_scale_factor``, generation tokens
``params.threshold_scale_factor_decode``. The paths taken and the skip counters of the last call
are queryable (:attr:`last_paths`, :attr:`last_skip_stats`). On CPU the kernels run only under
the Triton interpreter (``TRITON_INTERPRET=1`` set before kvsieve is imported).
"""
from __future__ import annotations

import os

import torch

from ...kernels.triton import paged_prefill, select_prefill_path, sparse_gqa_decode, sparse_mla_decode
from ...metadata import AttentionMetadata
from ..params import SparseRuntimeParams
from .base import AttentionBackend, AttentionGeometry

__all__ = ["TritonBackend"]


def _token_slice(params: SparseRuntimeParams | None, start: int, stop: int
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Indices and re-based offsets of query tokens ``[start, stop)``."""
    if params is None or params.sparse_attn_indices is None:
        return None, None
    off = params.sparse_attn_offsets
    lo, hi = int(off[start]), int(off[stop])
    return params.sparse_attn_indices[:, lo:hi], (off[start: stop + 1] - lo).to(torch.int32)


class TritonBackend(AttentionBackend):
    name = "triton"
    kv_page_granular = True

    def __init__(self) -> None:
        self.last_paths: dict[str, str] = {}
        self.last_skip_stats: tuple[int, int] = (0, 0)

    def forward(self, q: torch.Tensor, metadata: AttentionMetadata, layer_idx: int, geometry: AttentionGeometry,
                params: SparseRuntimeParams | None) -> tuple[torch.Tensor, torch.Tensor]:
        if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the triton backend needs CUDA tensors, or TRITON_INTERPRET=1 set before kvsieve "
                             "is imported to run its kernels on CPU; on CPU use backend 'torch'")
        mgr = metadata.kv_cache_manager
        table, tok_req, lens = metadata.block_table, metadata.token_to_req, metadata.token_kv_lens
        stats = torch.zeros(2, dtype=torch.int64, device=q.device)
        n_tok, n_ctx = q.shape[0], metadata.num_ctx_tokens
        factor_ctx = params.threshold_scale_factor if params is not None else 0.0
        factor_gen = params.decode_threshold if params is not None else 0.0
        bs = params.sparse_attn_indices_block_size if params is not None else 1
        self.last_paths = {}
        if geometry.kind == "mla":
            idx, off = _token_slice(params, 0, n_tok)
            if factor_ctx != factor_gen and n_ctx and n_ctx < n_tok:
                raise ValueError("MLA skip-softmax with different prefill/decode factors needs separate steps")
            out, lse = sparse_mla_decode(q, mgr.latent_cache(layer_idx), table, tok_req, lens, idx, off,
                                         geometry.kv_lora_rank, geometry.sm_scale,
                                         factor_gen if n_ctx == 0 else factor_ctx, stats, block_size=bs)
            self.last_paths["all"] = "mla_gather"
            self.last_skip_stats = tuple(int(x) for x in stats.tolist())
            return out, lse
        k_cache, v_cache = mgr.k_cache(layer_idx), mgr.v_cache(layer_idx)
        out = torch.empty(n_tok, geometry.num_q_heads, geometry.value_dim, dtype=q.dtype, device=q.device)
        lse = torch.empty(n_tok, geometry.num_q_heads, dtype=torch.float32, device=q.device)
        for name, start, stop, kernel, factor in (
            ("context", 0, n_ctx, paged_prefill, factor_ctx),
            ("generation", n_ctx, n_tok, sparse_gqa_decode, factor_gen),
        ):
            if stop == start:
                continue
            idx, off = _token_slice(params, start, stop)
            o, l = kernel(q[start:stop], k_cache, v_cache, table, tok_req[start:stop], lens[start:stop], idx, off,
                          bs, geometry.sm_scale, factor, stats)
            out[start:stop], lse[start:stop] = o, l
            self.last_paths[name] = select_prefill_path(idx) if name == "context" else "decode_gather"
        self.last_skip_stats = tuple(int(x) for x in stats.tolist())
        return out, lse
