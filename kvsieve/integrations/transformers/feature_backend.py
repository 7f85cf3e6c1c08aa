"""A backend wrapper that applies each layer's :class:`LayerFeatures` around any kvsieve backend.

* **Sliding window = a selection.** A windowed layer's step gets token-granular
  ``sparse_attn_indices`` covering each query's window (:func:`window_params`); when a selector
  also chose, its selection is intersected with the window (so no backend ever reads outside
  it, and the reported attended fraction counts only what was read). The selector itself was
  told the window (``SelectorInputs.window``) and chose inside it; the intersection is the
  guarantee, not where the choice is made. Every backend consumes
  token selections, so every backend honours windows.
* **Attention sinks** are applied exactly from the backend's ``(out, lse)``: a sink logit ``s_h``
  joins the softmax with a zero value, so ``out' = out / (1 + exp(s_h - lse))`` per query head
  (:func:`apply_sinks`). This needs a real LSE, so sink layers never take the SDPA fast path.
* **Logit soft-capping** changes the scores inside the softmax; no kvsieve kernel implements it.
  Softcap layers run :func:`softcapped_attention` (plain PyTorch over the selection mask, the
  Vanilla golden's math with the cap) in place of a backend that declares its math plain PyTorch
  (``BackendCapabilities.torch_softcap``: ``vanilla`` and ``torch``); a backend that does not (the
  kernel backends) is refused on a softcap model, by name (:func:`check_backend`).
* **Dense fast path.** A step with no selection (only the window, if any) runs torch SDPA over
  each request's K/V gathered from the paged cache, with a banded causal mask for windows; a
  request's lone decode token whose keys all lie in its window is read in place by the native CPU
  kernel instead (path ``native_dense``; fp32 math over the cache's values) where it applies. The
  step's result has ``lse=None`` (SDPA returns none; transformers never reads it).
"""
from __future__ import annotations

import dataclasses

import torch

from ...metadata import AttentionMetadata, KVCacheManager
from ...sparse.backends import AttentionBackend, AttentionGeometry, AttentionResult, BackendCapabilities
from ...sparse.backends.sdpa import causal_sdpa, gather_blocks, native_dense_decode, sdpa_gqa
from ...sparse.params import SparseRuntimeParams, is_dense
from ...sparse.selection import selection_mask
from ...sparse.window import window_counts, window_params
from .attention_features import LayerFeatures

__all__ = ["FeatureBackend", "apply_sinks", "softcapped_attention", "check_backend", "gather_request_kv"]


def check_backend(backend: AttentionBackend, features: list[LayerFeatures]) -> None:
    """Refuse a backend that cannot honour a feature some layer uses, naming both: soft-capping
    needs a backend whose capabilities declare ``torch_softcap`` (:func:`softcapped_attention`
    stands in for its math)."""
    caps = sorted({f.softcap for f in features if f.softcap is not None})
    if caps and not backend.capabilities.torch_softcap:
        raise ValueError(f"backend {backend.name!r} cannot apply attention logit soft-capping "
                         f"(attn_logit_softcapping={caps[0]}): its capabilities do not declare torch_softcap "
                         "(plain-PyTorch math, for which softcapped attention stands in); the built-in "
                         "backends 'vanilla' and 'torch' do")


def gather_request_kv(cache: KVCacheManager, layer_idx: int, request_id: int, *, head_major: bool = False,
                      scratch: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's valid K and V of a GQA layer, copied whole block by whole block (one
    ``index_select`` over the block ids instead of a per-position gather).

    Returns ``[L, Hkv, D]`` each, or ``[Hkv, L, D]`` with ``head_major``; with ``scratch``, views of
    a reused buffer (:func:`~kvsieve.sparse.backends.sdpa.gather_blocks`).
    """
    if cache.spec.kind != "gqa":
        raise ValueError(f"gather_request_kv: GQA caches only, this one is {cache.spec.kind!r}")
    k, v = gather_blocks(cache.pools[layer_idx], cache.spec.layout, cache.block_ids(request_id),
                         cache.valid_len(request_id), scratch)  # [Hkv, L, D] each
    return (k, v) if head_major else (k.transpose(0, 1), v.transpose(0, 1))


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Fold learned sink logits into a finished attention: ``out [T, Hq, Dv]``, natural-log
    ``lse [T, Hq]`` (``+inf`` on empty rows, whose out is 0), ``sinks [Hq]``. A sink joins the
    softmax denominator with a zero value: ``out / (1 + exp(sink - lse))``."""
    if lse is None or torch.isnan(lse).any():
        raise ValueError("apply_sinks needs a real LSE for every row; this backend path returned none")
    scale = torch.sigmoid(lse.float() - sinks.float().view(1, -1))  # 1 / (1 + exp(sink - lse))
    return (out.float() * scale.unsqueeze(-1)).to(out.dtype)


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sm_scale: float,
                         softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in fp32 with scores ``softcap * tanh(q.k * sm_scale / softcap)``.

    q ``[n, Hq, D]``, k ``[L, Hkv, D]``, v ``[L, Hkv, Dv]``, mask bool ``[Hkv, n, L]``.
    Returns out ``[n, Hq, Dv]`` fp32 and lse ``[n, Hq]`` fp32 (out 0 / lse +inf on empty rows).
    """
    hq, hkv = q.shape[1], k.shape[1]
    n = q.shape[0]
    s = torch.einsum("nhgd,lhd->hgnl", q.float().view(n, hkv, hq // hkv, q.shape[2]), k.float()) * sm_scale
    s = (torch.tanh(s / softcap) * softcap).masked_fill(~mask.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hkv, g, n]
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    out = torch.einsum("hgnl,lhd->nhgd", p, v.float()).reshape(n, hq, v.shape[-1])
    lse = torch.where(torch.isneginf(lse), torch.inf, lse)
    return out, lse.permute(2, 0, 1).reshape(n, hq)


class FeatureBackend(AttentionBackend):
    """Wraps a backend for a model whose layers have :class:`LayerFeatures` (indexed by layer).

    ``dense_fast_path``: steps without a selection run torch SDPA (see the module docstring).
    """

    def __init__(self, inner: AttentionBackend, features: list[LayerFeatures], *, dense_fast_path: bool) -> None:
        check_backend(inner, features)
        inner_caps = inner.capabilities
        # GQA only; the window (its banded SDPA fast path), sinks and, over plain-PyTorch inner
        # backends, softcap are applied here
        self.capabilities = BackendCapabilities(
            attention_kinds=frozenset({"gqa"}), dtypes=inner_caps.dtypes, devices=inner_caps.devices,
            skip_softmax_devices=inner_caps.skip_softmax_devices, softcap=inner_caps.torch_softcap, sinks=True,
            window=True)
        self.inner = inner
        self.features = features
        self.dense_fast_path = dense_fast_path
        self.name = f"{inner.name}+sdpa_dense" if dense_fast_path else inner.name
        self.required_translations = inner.required_translations
        self.kv_page_granular = inner.kv_page_granular
        self._scratch: dict[str, torch.Tensor] = {}  # the dense fast path's reused K/V gather buffer

    def _params(self, params: SparseRuntimeParams | None, metadata: AttentionMetadata, layer_idx: int,
                geometry: AttentionGeometry) -> SparseRuntimeParams | None:
        window = self.features[layer_idx].window
        if window is None:
            return params
        return window_params(params, metadata, geometry.num_kv_heads, window)

    def forward(self, q: torch.Tensor, metadata: AttentionMetadata, layer_idx: int, geometry: AttentionGeometry,
                params: SparseRuntimeParams | None) -> AttentionResult:
        """The inner backend's result for the layer's features; ``attended`` counts the window in."""
        f = self.features[layer_idx]
        if geometry.kind != "gqa":
            raise ValueError(f"FeatureBackend: GQA layers only, layer {layer_idx} is {geometry.kind!r}")
        phases = metadata.phases()
        if f.softcap is not None:
            if params is not None and any(params.threshold_scale_factor(p) > 0 for p in phases):
                raise ValueError(f"layer {layer_idx}: skip-softmax thresholds cannot be combined with logit "
                                 f"soft-capping (softcap={f.softcap})")
            wparams = self._params(params, metadata, layer_idx, geometry)
            out, lse = self._softcapped(q, metadata, layer_idx, geometry, wparams, f.softcap)
            res = AttentionResult(out, lse, self.inner.effective_attended_tokens(wparams, metadata, geometry),
                                  {p: "softcap_torch" for p in phases})
        elif self.dense_fast_path and all(is_dense(params, p) for p in phases) and f.sinks is None:
            out, path = self._sdpa(q, metadata, layer_idx, geometry, f.window)
            if f.window is None:
                attended = self.inner.effective_attended_tokens(None, metadata, geometry)
            else:  # counted from the lengths: the window's selection would be [T, Hkv, window] indices
                page = metadata.kv_cache_manager.tokens_per_block if self.inner.kv_page_granular else 1
                attended = window_counts(metadata.token_kv_lens, geometry.num_kv_heads, f.window, page)
            res = AttentionResult(out, None, attended, {p: path for p in phases})
        else:
            res = self.inner.forward(q, metadata, layer_idx, geometry, self._params(params, metadata, layer_idx, geometry))
        if f.sinks is not None:
            res = dataclasses.replace(res, out=apply_sinks(res.out, res.lse, f.sinks.detach().to(res.out.device)))
        return res

    def effective_attended_tokens(self, params: SparseRuntimeParams | None, metadata: AttentionMetadata,
                                  geometry: AttentionGeometry) -> torch.Tensor:
        """Without a layer's window (this interface has no layer); :meth:`forward`'s result counts it."""
        return self.inner.effective_attended_tokens(params, metadata, geometry)

    def _softcapped(self, q: torch.Tensor, metadata: AttentionMetadata, layer_idx: int, geometry: AttentionGeometry,
                    params: SparseRuntimeParams | None, softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.zeros(q.shape[0], q.shape[1], geometry.value_dim, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:2], torch.inf, dtype=torch.float32, device=q.device)
        for i, rid in enumerate(metadata.request_ids):
            t0, t1 = (int(x) for x in metadata.query_start_host[i: i + 2])
            if t1 == t0:
                continue
            k, v = gather_request_kv(metadata.kv_cache_manager, layer_idx, rid)  # [L, Hkv, D]
            mask = selection_mask(params, slice(t0, t1), metadata.token_kv_lens, k.shape[0], geometry.num_kv_heads)
            out[t0:t1], lse[t0:t1] = softcapped_attention(q[t0:t1], k, v, mask.to(q.device), geometry.sm_scale, softcap)
        return out.to(q.dtype), lse

    def _sdpa(self, q: torch.Tensor, metadata: AttentionMetadata, layer_idx: int, geometry: AttentionGeometry,
              window: int | None) -> tuple[torch.Tensor, str]:
        """The dense fast path's output and its path: ``sdpa_dense``/``sdpa_window``, ``native_dense``
        when every request's row was a lone decode token the native CPU kernel read in place, or
        both joined by ``+``."""
        out = torch.zeros(q.shape[0], q.shape[1], geometry.value_dim, dtype=q.dtype, device=q.device)
        cache = metadata.kv_cache_manager
        paths = set()
        for i, rid in enumerate(metadata.request_ids):
            t0, t1 = (int(x) for x in metadata.query_start_host[i: i + 2])
            if t1 == t0:
                continue
            kv_len = cache.valid_len(rid)
            if t1 - t0 == 1 and (window is None or kv_len <= window):  # a decode token: in place, no gather
                o = native_dense_decode(cache.pools[layer_idx], cache.spec.layout, cache.block_ids(rid), kv_len,
                                        q[t0], geometry.sm_scale)
                if o is not None:
                    out[t0] = o.to(q.dtype)
                    paths.add("native_dense")
                    continue
            paths.add("sdpa_dense" if window is None else "sdpa_window")
            k, v = gather_request_kv(metadata.kv_cache_manager, layer_idx, rid, head_major=True,
                                     scratch=self._scratch)  # [Hkv, L, D], views of the scratch buffer
            k, v = k.to(q.dtype), v.to(q.dtype)
            n, kv_len = t1 - t0, k.shape[1]
            if window is None or kv_len <= window:
                out[t0:t1] = causal_sdpa(q[t0:t1], k, v, geometry.sm_scale)
                continue
            # windowed: query chunks, each against the keys its window spans (a band, not the square)
            step = max(window, _WINDOW_CHUNK)
            for c0 in range(0, n, step):
                c1 = min(n, c0 + step)
                qpos = kv_len - n + torch.arange(c0, c1, device=q.device)  # each query's position
                first = max(0, int(qpos[0]) - window + 1)
                kpos = torch.arange(first, int(qpos[-1]) + 1, device=q.device)
                mask = (kpos <= qpos[:, None]) & (kpos > qpos[:, None] - window)
                out[t0 + c0:t0 + c1] = sdpa_gqa(q[t0 + c0:t0 + c1], k[:, first:int(qpos[-1]) + 1],
                                                v[:, first:int(qpos[-1]) + 1], mask, False, geometry.sm_scale)
        return out, "+".join(sorted(paths)) or ("sdpa_dense" if window is None else "sdpa_window")


#: query rows per SDPA call on a windowed layer (each call reads its rows' keys plus one window)
_WINDOW_CHUNK = 1024
