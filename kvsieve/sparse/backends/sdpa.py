"""``sdpa``: dense phases through torch SDPA, everything else through an inner backend.

A step in which no phase present selects positions or skips softmax
(:func:`kvsieve.sparse.params.is_dense`; prompt-eviction indices alone do not change the
attention) runs ``torch.nn.functional.scaled_dot_product_attention`` over each request's K/V
gathered through its block list; any other step goes whole to the inner backend (``inner``,
default ``"vanilla"``) and its result — paths, counts, skip statistics — comes back unchanged.
The dense prefill of a 4K prompt through the Vanilla golden materializes ``[H, S, L]`` fp32
scores per layer; SDPA is the same math, fused. SDPA computes no LSE: a step it serves returns
``lse=None``.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ...kernels.common.native import NativeUnavailable
from ...kernels.sparse_gqa_decode.native import sparse_decode_native, supports_native
from ...metadata import AttentionMetadata
from ..params import SparseRuntimeParams, is_dense
from .base import BACKENDS, AttentionBackend, AttentionGeometry, AttentionResult, register_backend

__all__ = ["SdpaBackend", "causal_sdpa", "sdpa_gqa", "gather_blocks", "native_dense_decode"]


@register_backend
class SdpaBackend(AttentionBackend):
    name = "sdpa"

    def __init__(self, inner: str | AttentionBackend = "vanilla") -> None:
        self.inner = BACKENDS.get(inner)() if isinstance(inner, str) else inner
        if isinstance(self.inner, SdpaBackend):
            raise ValueError("the sdpa backend's inner backend cannot be sdpa itself")
        self.required_translations = tuple(sorted({"block_lists", *self.inner.required_translations}))
        self.kv_page_granular = self.inner.kv_page_granular
        # SDPA serves dense GQA steps, any dtype and device; its fused kernel is not the inner
        # backend's math, so no plain-PyTorch softcap stands in for it
        self.capabilities = dataclasses.replace(self.inner.capabilities, torch_softcap=False)

    def forward(self, q: torch.Tensor, metadata: AttentionMetadata, layer_idx: int, geometry: AttentionGeometry,
                params: SparseRuntimeParams | None) -> AttentionResult:
        metadata.require(f"backend {self.name!r}", self.required_translations)
        if geometry.kind != "gqa" or not all(is_dense(params, p) for p in metadata.phases()):
            return self.inner.forward(q, metadata, layer_idx, geometry, params)
        mgr = metadata.kv_cache_manager
        out = torch.zeros(q.shape[0], q.shape[1], geometry.value_dim, dtype=q.dtype, device=q.device)
        for i in range(metadata.num_seqs):
            t0, t1 = (int(x) for x in metadata.query_start_host[i: i + 2])
            if t1 == t0:
                continue
            kv_len = int(metadata.kv_lens_host[i])
            k, v = gather_blocks(mgr.pools[layer_idx], mgr.spec.layout, metadata.block_ids_per_seq[i], kv_len)
            out[t0:t1] = causal_sdpa(q[t0:t1], k, v, geometry.sm_scale)
        return AttentionResult(out, None, self.effective_attended_tokens(None, metadata, geometry),
                               {p: "sdpa_dense" for p in metadata.phases()})


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One request's dense causal attention through torch SDPA: q ``[n, Hq, D]`` (its last ``n``
    positions), k/v ``[Hkv, kv_len, D]`` head-major (cast to q's dtype); the causal mask is aligned
    bottom-right (query ``i`` sees positions ``<= kv_len - n + i``). Returns ``[n, Hq, Dv]``."""
    n, kv_len = q.shape[0], k.shape[1]
    mask = None
    if 1 < n < kv_len:
        mask = torch.arange(kv_len, device=q.device) <= (kv_len - n + torch.arange(n, device=q.device))[:, None]
    return sdpa_gqa(q, k.to(q.dtype), v.to(q.dtype), mask, n == kv_len and n > 1, scale)


def sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
             scale: float) -> torch.Tensor:
    """torch SDPA with grouped KV heads: q ``[n, Hq, D]``, k/v ``[Hkv, L, D]`` (q's dtype), ``mask``
    bool ``[n, L]`` or ``None``, ``causal`` top-left aligned. Returns ``[n, Hq, Dv]``.

    One query token that sees every key (the decode step: no mask, not causal) is sent as
    ``Hq / Hkv`` query rows of its KV head, ``[1, Hkv, G, D]``: the same attention, but one
    ``[G, L]`` product per KV head instead of SDPA's ``enable_gqa`` broadcast, which on CPU costs
    about 2x (fp32) to 6x (bf16) more at 32K keys (torch 2.13, one thread)."""
    n, hq, d = q.shape
    hkv = k.shape[0]
    if n == 1 and mask is None and not causal:
        o = torch.nn.functional.scaled_dot_product_attention(
            q.reshape(1, hkv, hq // hkv, d), k.unsqueeze(0), v.unsqueeze(0), scale=scale)
        return o.reshape(1, hq, v.shape[-1])
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, is_causal=causal,
        scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def gather_blocks(pool: torch.Tensor, layout: str, block_ids: list[int], kv_len: int,
                  scratch: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's valid K and V, head-major ``[Hkv, kv_len, D]`` each, copied whole block by
    whole block (one ``index_select`` over its block list, not a per-position gather).

    A contiguous HND pool ``[blocks, 2, Hkv, P, D]`` is read as rows of ``P * D`` (one per block,
    K/V half and head) gathered straight into head-major order: one copy, into
    ``scratch["kv"]`` when a ``scratch`` dict is given (a grow-only buffer the caller keeps across
    calls: a fresh multi-MiB tensor per call is a fresh mmap whose page faults cost more than the
    copy; the result is a view of it, valid until the next call with the same dict). NHD gathers
    the blocks, then reorders them (a second copy)."""
    if layout == "HND" and pool.is_contiguous():
        _, _, hkv, page, d = pool.shape
        ids = np.asarray(block_ids, dtype=np.int64)
        # [2, Hkv, n]: the row of (K/V, head, block), computed on the host (a few hundred entries)
        rows = (ids[None, None, :] * 2 + np.arange(2)[:, None, None]) * hkv + np.arange(hkv)[None, :, None]
        flat, rows = pool.view(-1, page * d), torch.from_numpy(rows.ravel()).to(pool.device)
        if scratch is None:
            kv = flat.index_select(0, rows)
        else:
            buf = scratch.get("kv")
            if buf is None or buf.numel() < rows.numel() * flat.shape[1] or buf.dtype != pool.dtype:
                buf = scratch["kv"] = torch.empty(rows.numel() * flat.shape[1], dtype=pool.dtype, device=pool.device)
            kv = torch.index_select(flat, 0, rows, out=buf[: rows.numel() * flat.shape[1]].view(-1, flat.shape[1]))
        kv = kv.view(2, hkv, -1, d)[:, :, :kv_len]
        return kv[0], kv[1]
    sel = pool.index_select(0, torch.as_tensor(block_ids, dtype=torch.long, device=pool.device))
    # HND [n, 2, Hkv, P, D] / NHD [n, 2, P, Hkv, D] -> [2, Hkv, n, P, D]
    sel = sel.permute(1, 3, 0, 2, 4) if layout == "NHD" else sel.permute(1, 2, 0, 3, 4)
    kv = sel.reshape(2, sel.shape[1], -1, sel.shape[-1])[:, :, :kv_len]
    return kv[0], kv[1]


def native_dense_decode(pool: torch.Tensor, layout: str, block_ids: list[int], kv_len: int, q: torch.Tensor,
                        sm_scale: float) -> torch.Tensor | None:
    """One query row's attention over positions ``[0, kv_len)`` of a request, by the native CPU
    kernel (:mod:`kvsieve.kernels.sparse_gqa_decode.native`) reading the request's blocks of the pool in
    place: no gather. ``pool`` a contiguous HND pool ``[blocks, 2, Hkv, P, D]``, ``q [Hq, D]``.
    Returns out fp32 ``[Hq, D]``, or ``None`` where the kernel does not apply (another layout or
    device, an unsupported dtype or shape, or its library unavailable)."""
    if layout != "HND" or not pool.is_contiguous() or kv_len < 1:
        return None
    _, _, hkv, page, d = pool.shape
    rows = pool.view(-1, page * d)
    if not supports_native(rows, q, hkv):
        return None
    ids = np.asarray(block_ids[: -(-kv_len // page)], dtype=np.int64)
    k_rows = ids[None, :] * (2 * hkv) + np.arange(hkv)[:, None]  # [Hkv, blocks]: K rows; V rows Hkv further
    cnt = np.broadcast_to(np.minimum(kv_len - np.arange(ids.size) * page, page), k_rows.shape)
    try:
        return sparse_decode_native(rows, k_rows, cnt, hkv, q, sm_scale=sm_scale)[0]
    except NativeUnavailable:
        return None
