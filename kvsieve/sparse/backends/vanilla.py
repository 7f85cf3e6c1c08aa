"""The golden: per request, gather the paged KV into contiguous NHD tensors through its block
list (the ``block_lists`` translation), mask to the selection, and run plain softmax attention in
fp32. Written for clarity, not speed. A phase with a skip-softmax factor runs the Triton kernels'
tile walk instead (:mod:`.skip_softmax`), per request, over the same contiguous K/V."""
from __future__ import annotations

import torch

from ...metadata import AttentionMetadata, KVCacheManager
from ..params import SparseRuntimeParams
from ..selection import selection_mask
from .base import AttentionBackend, AttentionGeometry, AttentionResult, BackendCapabilities, register_backend
from .skip_tiling import skip_softmax_phase

__all__ = ["VanillaBackend", "masked_attention", "gather_nhd"]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference softmax attention in fp32.

    q ``[n, Hq, D]``, k ``[L, Hkv, D]``, v ``[L, Hkv, Dv]``, mask bool ``[Hkv, n, L]``.
    Returns out ``[n, Hq, Dv]`` fp32 and lse ``[n, Hq]`` fp32 (out 0 / lse +inf on empty rows).
    """
    hq, hkv = q.shape[1], k.shape[1]
    g = hq // hkv
    qf = q.float().view(q.shape[0], hkv, g, q.shape[2])
    s = torch.einsum("nhgd,lhd->hgnl", qf, k.float()) * sm_scale
    m = mask.unsqueeze(1)  # [Hkv, 1, n, L]
    s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hkv, g, n]
    empty = torch.isneginf(lse)
    p = torch.exp(s - torch.where(empty, 0.0, lse).unsqueeze(-1)).masked_fill(~m, 0.0)
    out = torch.einsum("hgnl,lhd->nhgd", p, v.float())
    lse = torch.where(empty, torch.inf, lse)
    n = q.shape[0]
    return out.reshape(n, hq, v.shape[-1]), lse.permute(2, 0, 1).reshape(n, hq)


def gather_nhd(mgr: KVCacheManager, layer_idx: int, block_ids: list[int], kv_len: int,
                geometry: AttentionGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's K and V as contiguous NHD ``[kv_len, Hkv, D]`` read through its block list
    (MLA: the latent as K with one head, its first ``kv_lora_rank`` columns as V)."""
    page = mgr.tokens_per_block
    pos = torch.arange(kv_len)
    blocks = torch.tensor(block_ids, dtype=torch.int64)[pos // page].to(mgr.spec.device)
    offs = (pos % page).to(mgr.spec.device)
    if geometry.kind == "mla":
        lat = mgr.latent_cache(layer_idx)[blocks, offs].unsqueeze(1)
        return lat, lat[..., : geometry.kv_lora_rank]
    return mgr.k_cache(layer_idx)[blocks, :, offs], mgr.v_cache(layer_idx)[blocks, :, offs]


@register_backend
class VanillaBackend(AttentionBackend):
    name = "vanilla"
    # skip-softmax rebuilds the Triton kernels' CPU launch table (skip_tiling): CPU only;
    # plain PyTorch: a soft-capped layer may run the plain-PyTorch softcapped attention instead
    capabilities = BackendCapabilities(skip_softmax_devices=frozenset({"cpu"}), torch_softcap=True)
    required_translations = ("block_lists",)

    def forward(self, q: torch.Tensor, metadata: AttentionMetadata, layer_idx: int, geometry: AttentionGeometry,
                params: SparseRuntimeParams | None) -> AttentionResult:
        metadata.require(f"backend {self.name!r}", self.required_translations)
        mgr = metadata.kv_cache_manager
        out = torch.zeros(q.shape[0], q.shape[1], geometry.value_dim, dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[0], q.shape[1]), torch.inf, dtype=torch.float32, device=q.device)
        token_lens = metadata.token_kv_lens
        paths = {p: "masked_fp32" for p in metadata.phases()}
        skipped = walked = 0
        for i in range(metadata.num_seqs):
            t0, t1 = (int(x) for x in metadata.query_start_host[i: i + 2])
            if t1 == t0:
                continue
            kv_len = int(metadata.kv_lens_host[i])
            k, v = gather_nhd(mgr, layer_idx, metadata.block_ids_per_seq[i], kv_len, geometry)
            phase = "context" if metadata.is_context(i) else "generation"
            if params is not None and params.threshold_scale_factor(phase) > 0:
                kf, vf = k.float().cpu(), v.float().cpu()
                heads = torch.arange(geometry.num_kv_heads).view(-1, 1, 1)
                o, l, sk, wk, paths[phase] = skip_softmax_phase(
                    self.name, q, metadata, geometry, params, phase, slice(t0, t1),
                    lambda _, p: kf[p, heads], lambda _, p: vf[p, heads], lambda _, p: kf[p], lambda _, p: vf[p])
                out[t0:t1], lse[t0:t1] = o.to(q.device), l.to(q.device)
                skipped, walked = skipped + sk, walked + wk
                continue
            sel = params if params is not None and params.selects_positions(phase) else None
            mask = selection_mask(sel, slice(t0, t1), token_lens, kv_len, geometry.num_kv_heads).to(q.device)
            o, l = masked_attention(q[t0:t1], k, v, mask, geometry.sm_scale)
            out[t0:t1], lse[t0:t1] = o, l
        return AttentionResult(out.to(q.dtype), lse, self.effective_attended_tokens(params, metadata, geometry),
                               paths, skipped, walked)
