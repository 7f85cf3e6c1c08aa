"""Run a Hugging Face ``transformers`` decoder through kvsieve: paged cache, selectors, backend.

::

    with kvsieve.apply(model, "quest", budget=256):      # one line (:mod:`.apply_model`); restores the model on exit
        model.generate(input_ids, max_new_tokens=32)

    from kvsieve import SparseAttentionConfig
    from kvsieve.integrations.transformers import KvsieveSession

    cfg = SparseAttentionConfig("oracle_topk", {"budget": 64}, phases=("generation",))
    session = KvsieveSession(model, cfg)                 # backend: torch on CPU, triton on CUDA
    new_tokens = session.generate(input_ids, max_new_tokens=8)        # [B, n]
    session.attended_fraction("generation")                          # per layer

Constructing a session registers (:mod:`.hooks`) the attention function ``"kvsieve"``
with transformers' ``AttentionInterface`` and a mask function under the same name with ``AttentionMaskInterface``
(it returns ``None``: kvsieve applies causality from its own ledger, so transformers never builds
an ``[S, L]`` mask), then calls ``model.set_attn_implementation("kvsieve")``. Every attention
module gets a reference to the session; the attention function maps transformers' ``query
[B, Hq, S, D]`` / ``key, value [B, Hkv, S_kv, D]`` (after RoPE, before GQA repetition) onto
kvsieve's token-major ``[B*S, H, D]`` and runs that layer's :class:`SparseAttention`.

A selector that reads per-step model inputs (DSA's ``IndexerInputs``) gets them through the
attention call itself: a forward pre-hook on the attention module puts them in the keyword
argument :data:`~.hooks.MODEL_INPUTS_KWARG`, the module's own code passes its keyword arguments on to the
attention function, and that hands them to the layer's ``forward(..., model_inputs=)``
(:func:`kvsieve.integrations.transformers.attach_dsa_indexer` is such a hook).

Every layer's attention features (sliding window, softcap, sinks, scaling) are read when the
session is built (:mod:`.attention_features`) and applied around the backend
(:mod:`.feature_backend`); every call's keyword arguments are checked against them, and anything
kvsieve does not implement raises, naming it.

Two ways to drive it:

* **session-driven** (:meth:`KvsieveSession.prefill`, :meth:`decode`, :meth:`generate`): the model
  runs with ``use_cache=False``, so kvsieve's paged cache is the only KV cache; one model forward
  is one kvsieve step (``Engine.begin_step`` before layer 0, ``end_step`` after the last layer).
* **transformers-driven** (``model.generate`` after the session is built): transformers still
  keeps its own cache and hands over the whole history; the function keeps only the last ``S``
  positions (the step's new tokens) for kvsieve. A forward whose key length equals its query
  length starts new requests (the previous ones are freed). Beam search works: transformers'
  ``_reorder_cache`` hook reorders the paged cache's rows with its own (blocks shared, copied on
  write); a ``past_key_values`` the session did not build, and ``generate(use_cache=False)`` under
  a decode-phase selector, are refused (:mod:`.generate_link`).

Batches are ``B`` equal-length rows without padding (request ids ``0..B-1``). Without
``max_batch`` the session sizes its paged cache for the batch of the first step (and grows it at
a later step that starts new requests with more rows, keeping its prefix cache); ``max_batch``
fixes it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from ...metadata import AttentionMetadata, KVCacheManager, KVCacheSpec
from ...sparse import Engine, LayerOutput, SparseAttention, SparseAttentionConfig, get_backend, lower_config
from ...sparse.backends import default_backend
from ...sparse.speculation import AcceptanceStats
from .attention_features import LayerFeatures, read_layer_features
from .feature_backend import FeatureBackend
from .generate_link import GenerateLink
from .golden_check import GOLDEN_TRANSLATIONS, GoldenCheck
from .hooks import ATTN_IMPLEMENTATION, SESSION_ATTR, attention_modules, head_dims, register_attention
from .speculate import SessionSpeculation, speculation_refusal
from .steps import SessionSteps

__all__ = ["KvsieveSession", "LayerObserver"]

#: ``observer(layer_idx, q [T, Hq, D], result, metadata, layer)`` after each layer forward: ``result`` is
#: what the layer's forward returned (:class:`~kvsieve.sparse.LayerOutput`: ``out [T, Hq, Dv]`` cut to the
#: model's value dim, the placed ``params``, ``stats``, ``paths``).
LayerObserver = Callable[[int, torch.Tensor, LayerOutput, AttentionMetadata, SparseAttention], None]


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width)) if width else x


class KvsieveSession(SessionSteps, SessionSpeculation):
    """Owns a kvsieve :class:`Engine` (paged cache + one :class:`SparseAttention` per decoder layer)
    attached to a transformers causal LM.

    ``config``: the selector (``None`` = dense everywhere); ``backend``: a kvsieve backend name;
    ``dense_fast_path``: run steps without a selection through torch SDPA over the paged KV
    (see :class:`~kvsieve.integrations.transformers.feature_backend.FeatureBackend`); ``max_tokens``:
    per-request capacity of the paged cache;
    ``max_batch``: rows (requests, beams) the paged cache holds; ``None`` sizes it for the first
    step's batch and grows it when a later step starts more new requests;
    ``decode_threads``: torch intra-op threads during :meth:`decode` (on a CPU, one thread is
    faster for one-token steps: their ops are too small to repay thread hand-offs);
    ``release_windows``: the sliding-window layers of a hybrid model have their own cache group
    (their own length: the full-attention layers may evict without them); with this flag that group
    drops blocks wholly out of the window after each step (held blocks stay bounded, and
    :meth:`rewind` refuses a length whose window was dropped); ``False`` keeps them.
    ``check_steps``: compare that many random generation steps with the Vanilla golden
    (:class:`~kvsieve.integrations.transformers.golden_check.GoldenCheck`, kept as :attr:`golden_check`).
    ``prefix_caching``: :meth:`prefill` adds its rows with their token ids, so a prompt whose
    leading whole blocks an earlier prompt computed (the blocks stay cached after their requests
    end, until the allocator needs them) holds those blocks by reference and the model runs only
    on the rest (the positions every row of the batch reuses); a new config forgets the cached
    blocks. Refused on a model with sliding-window layers (several cache groups) and with a
    selector that evicts prompt tokens (it would see only the part of the prompt that runs).
    ``speculate``: lossless sparse decoding, ``K`` tokens drafted by the selector and verified by
    one dense pass per round (:mod:`.speculate`, ``docs/lossless.md``): ``model.generate`` and
    :meth:`speculative_generate` decode so; refused with a config it cannot draft with, with
    prefix caching, and with ``release_windows`` on a model with sliding-window layers (a rejected
    draft rolls back to positions the window still reads).
    """

    def __init__(self, model: torch.nn.Module, config: SparseAttentionConfig | None = None, *,
                 backend: str | None = None, max_tokens: int = 8448, max_batch: int | None = None,
                 tokens_per_block: int = 16,
                 dense_fast_path: bool = True, decode_threads: int | None = None, debug: bool = False,
                 check_steps: int = 0, release_windows: bool = True, prefix_caching: bool = False,
                 speculate: int | None = None) -> None:
        if decode_threads is not None and decode_threads < 1:
            raise ValueError(f"decode_threads must be >= 1 or None, got {decode_threads}")
        if max_tokens < 1 or (max_batch is not None and max_batch < 1) or tokens_per_block < 1:
            raise ValueError(f"max_tokens, max_batch and tokens_per_block must be >= 1, got "
                             f"{max_tokens}, {max_batch}, {tokens_per_block}")
        cfg = model.config
        self.model = model
        self.modules = attention_modules(model)
        self.num_layers = len(self.modules)
        self.features: list[LayerFeatures] = read_layer_features(cfg, self.modules)
        num_q = cfg.num_attention_heads
        self.key_dim, self.value_dim = head_dims(cfg)
        # MLA models (DeepSeek) hand over decompressed per-head K and V: multi-head attention
        num_kv = num_q if self.key_dim != self.value_dim or hasattr(cfg, "kv_lora_rank") else (
            getattr(cfg, "num_key_value_heads", None) or num_q)
        head_dim = max(self.key_dim, self.value_dim)  # the narrower of K/V is zero-padded (exact)
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        self._cache_spec = dict(num_layers=self.num_layers, tokens_per_block=tokens_per_block, num_kv_heads=num_kv,
                                head_dim=head_dim, dtype=dtype, device=device,
                                max_blocks_per_seq=-(-max_tokens // tokens_per_block))
        self.backend = FeatureBackend(get_backend(backend or default_backend(device)), self.features,
                                      dense_fast_path=dense_fast_path)
        self.layers = [
            SparseAttention(layer_idx=i, num_q_heads=num_q, num_kv_heads=num_kv, head_dim=head_dim,
                            backend=self.backend, sm_scale=f.scaling, debug=debug, window=f.window)
            for i, f in enumerate(self.features)
        ]
        self._translations = sorted(set(self.backend.required_translations) | set(GOLDEN_TRANSLATIONS)) \
            if check_steps else None
        self.max_tokens = max_tokens
        self.max_batch = max_batch
        self.release_windows = release_windows
        self.engine: Engine
        self._size_cache(max_batch or 1)
        if prefix_caching and len(self.engine.caches) > 1:
            raise ValueError(f"prefix_caching: the model's sliding-window layers (windows "
                             f"{sorted({w for w in self.engine.windows if w is not None})}) keep their own cache group, "
                             "whose blocks out of the window are released; prefix caching needs one cache group")
        self.prefix_caching = prefix_caching
        if speculate is not None and release_windows and len(self.engine.caches) > 1:
            raise ValueError("speculate: release_windows drops the blocks a sliding window has passed, but a rejected "
                             "draft rolls back to positions before them; build the session with release_windows=False")
        self.speculate = speculate
        self._acceptance = None if speculate is None else AcceptanceStats.empty(speculate)
        self._tracked = False  # the live requests were added with their token ids (prefix caching)
        self.decode_threads = decode_threads
        self.device = device
        self.observers: list[LayerObserver] = []
        self.golden_check = GoldenCheck(self.features, check_steps) if check_steps else None
        if self.golden_check is not None:
            self.observers.append(self.golden_check)
        self.config: SparseAttentionConfig | None = None
        self._request_ids: list[int] = []
        self.beam_width = 1  # rows per generation request at decode; model.generate sets num_beams
        self._next_pos = 0
        self._step_open = False
        self._driven = False
        self._stats = {p: np.zeros((self.num_layers, 2), dtype=np.float64) for p in ("context", "generation")}
        self._phase = "context"
        self.set_config(config)
        register_attention()
        self._previous_implementation = model.config._attn_implementation
        for m in self.modules:
            setattr(m, SESSION_ATTR, self)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self._link = GenerateLink(model, self)

    def _size_cache(self, rows: int) -> None:
        """(Re)build the paged cache (a hybrid model: one group for the full-attention layers, one
        per sliding window) and the engine for ``rows`` requests (no live requests). A rebuild for
        a wider batch keeps the prefix cache: the cached blocks move to the new cache
        (:meth:`~kvsieve.metadata.KVCacheManager.adopt_cached`)."""
        outgrown = self.engine.caches if hasattr(self, "engine") else []
        windows = [f.window for f in self.features]
        groups = sorted(set(windows), key=lambda w: -1 if w is None else w)
        caches = [KVCacheManager(KVCacheSpec(
            num_blocks=rows * self._cache_spec["max_blocks_per_seq"] + 1, max_requests=rows, **self._cache_spec,
            layers=None if len(groups) == 1 else tuple(i for i, w in enumerate(windows) if w == g)))
            for g in groups]
        self.engine = Engine(caches, self.layers, max_num_requests=rows, max_num_tokens=rows * self.max_tokens,
                             translations=self._translations, release_windows=self.release_windows)
        for layer in self.layers:
            layer.plan = layer.plan  # forget the old cache's requests and blocks
        for cache, old in zip(self.engine.caches, outgrown):
            cache.adopt_cached(old)
        self._rows_capacity = rows

    @property
    def cache(self) -> KVCacheManager:
        """The paged cache of the full-attention layers (the first cache group; the only one of a
        model without sliding windows); every group: ``engine.caches``."""
        return self.engine.caches[0]

    def close(self) -> None:
        """Detach from the model: its attention implementation returns to what it was before the
        session, the modules lose their session reference and the paged cache is freed."""
        for rid in self.engine.request_ids:
            self.engine.free(rid)
        self._request_ids = []
        self._step_open = False
        self._link.close()
        for m in self.modules:
            if getattr(m, SESSION_ATTR, None) is self:
                delattr(m, SESSION_ATTR)
        self.model.set_attn_implementation(self._previous_implementation)

    def __enter__(self) -> KvsieveSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- configuration ------------------------------------------------------------------
    def set_config(self, config: SparseAttentionConfig | None) -> None:
        """Lower ``config`` to per-layer plans and install them; takes effect at the next step.

        The model's layer types reach :func:`lower_config`, so ``config.layer_types`` can name them
        (by default a selector runs only on the full-attention layers of an interleaved model).
        A selector on a windowed layer is told the window and chooses only inside it (it must
        declare ``Capabilities.sliding_window``; one that does not, or that evicts prompt tokens,
        is refused by :func:`lower_config`, naming the layer and its type); the backend still
        intersects every selection with the window. Installed between steps of live requests (a
        dense prefill, then a sparse decode), a selector rebuilds its per-token state from the
        cache at the next step (:meth:`~kvsieve.sparse.SparseSelector.on_attach`), or that step is
        refused with the cache unchanged (:func:`~kvsieve.sparse.attach_refusal`, e.g. DSA, whose
        index keys come from hidden states the cache does not hold)."""
        plans = lower_config(config, num_layers=self.num_layers, device=self.device,
                             layer_types=[f.layer_type for f in self.features],
                             layer_windows=[f.window for f in self.features])
        why = None if self.speculate is None else speculation_refusal(self.speculate, plans,
                                                                      prefix_caching=self.prefix_caching)
        if why is not None:
            raise ValueError(why)
        evicting = sorted({p.selector.name for p in plans if p is not None and p.selector.capabilities.evicts})
        if self.prefix_caching and evicting:
            raise ValueError(f"prefix_caching: selector(s) {evicting} evict prompt tokens, but a prompt that reuses "
                             "cached blocks runs only its rest, so eviction would see part of the prompt; build the "
                             "session without prefix_caching")
        for i, (plan, f) in enumerate(zip(plans, self.features)):
            if plan is not None:
                if f.softcap is not None and plan.selector.name == "skip_softmax":
                    raise ValueError(f"selector 'skip_softmax' thresholds the raw scores, which layer {i} "
                                     f"soft-caps ({f.describe()}); not supported")
        for layer, plan in zip(self.layers, plans):
            layer.plan = plan
        for cache in self.engine.caches:  # blocks the old plans computed are not what the new ones would
            cache.forget_prefixes()
        self._tracked = False
        self.config = config

    # ---- session-driven stepping --------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Start new requests with prompts ``input_ids [B, S]``; returns last-position logits ``[B, V]``."""
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids must be [batch, seq_len >= 1], got {tuple(input_ids.shape)}")
        return self._run(input_ids, new_requests=True)

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Append ``token_ids [B]`` (or ``[B, S]`` for several tokens) and return logits ``[B, V]``."""
        ids = token_ids.view(-1, 1) if token_ids.dim() == 1 else token_ids
        if not self._request_ids:
            raise RuntimeError("decode before prefill: no live requests")
        if self.decode_threads is None:
            return self._run(ids, new_requests=False)
        threads = torch.get_num_threads()
        torch.set_num_threads(self.decode_threads)
        try:
            return self._run(ids, new_requests=False)
        finally:
            torch.set_num_threads(threads)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None) -> torch.Tensor:
        """Greedy decoding; returns the new tokens ``[B, n]`` (``n <= max_new_tokens``; stops when
        every row produced ``eos_token_id``)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        logits = self.prefill(input_ids)
        return self.continue_greedy(logits, max_new_tokens, eos_token_id)

    def continue_greedy(self, logits: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None,
                        stop: Callable[[torch.Tensor], bool] | None = None) -> torch.Tensor:
        """Greedy decoding from the last logits ``[B, V]`` of the live requests; new tokens ``[B, n]``.
        ``stop(tokens [B, n])`` may end the decoding early (checked after every token)."""
        out = []
        done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
        for i in range(max_new_tokens):
            tok = logits.argmax(-1)
            out.append(tok)
            if eos_token_id is not None:
                done |= tok == eos_token_id
                if bool(done.all()):
                    break
            if stop is not None and stop(torch.stack(out, dim=1)):
                break
            if i + 1 < max_new_tokens:
                logits = self.decode(tok)
        return torch.stack(out, dim=1)

    # ---- what transformers' generate loop asks (GenerateLink) ------------------------------
    @property
    def active(self) -> bool:
        """Whether the model's attention runs through this session now (not closed, not replaced by
        a later session or another attention implementation)."""
        return (self.model.config._attn_implementation == ATTN_IMPLEMENTATION
                and getattr(self.modules[0], SESSION_ATTR, None) is self)

    @property
    def driven(self) -> bool:
        """Whether a session-driven forward (:meth:`prefill`, :meth:`decode`) is running."""
        return self._driven

    @property
    def live_rows(self) -> int:
        """Rows (requests) the paged cache holds for the current generation."""
        return len(self._request_ids)

    def decode_phase_selectors(self) -> list[str]:
        """Names of the selectors planned for the generation phase on some layer."""
        return sorted({layer.plan.selector.name for layer in self.layers
                       if layer.plan is not None and "generation" in layer.plan.phases})

    def reorder_rows(self, beam_idx: torch.Tensor) -> None:
        """Row ``i`` of the live requests takes what row ``beam_idx[i]`` held (beam search)."""
        if self._step_open:
            raise RuntimeError("reorder_rows: a step is open")
        self.engine.reorder(self._request_ids, beam_idx.tolist())

    @property
    def num_cached_positions(self) -> int:
        """Positions the live requests have seen (the next RoPE position), eviction notwithstanding."""
        return self._next_pos

    def _attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                model_inputs: object = None) -> torch.Tensor:
        """query ``[B, Hq, S, D]``, key/value ``[B, Hkv, S_kv, D]`` (``S_kv >= S``) -> ``[B, S, Hq, D]``;
        ``model_inputs``: the layer's per-step model inputs for its selector (``B*S`` tokens)."""
        b, hq, s, d = query.shape
        if not self._step_open:
            if self._driven or layer_idx != 0:
                raise RuntimeError(f"kvsieve step not open at layer {layer_idx}")
            self._open_step(b, s, new_requests=key.shape[2] == s)
        layer = self.layers[layer_idx]
        g = layer.geometry
        if (hq, d, value.shape[-1]) != (g.num_q_heads, self.key_dim, self.value_dim) or key.shape[1] != g.num_kv_heads:
            raise ValueError(f"layer {layer_idx}: query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                             f"{tuple(value.shape)} do not match the session's heads ({g.num_q_heads} q, "
                             f"{g.num_kv_heads} kv) and head dims (key {self.key_dim}, value {self.value_dim})")
        pad = g.head_dim - d, g.head_dim - value.shape[-1]  # zero columns change no dot product
        k = _pad(key[:, :, -s:], pad[0]).transpose(1, 2).reshape(b * s, key.shape[1], g.head_dim)
        v = _pad(value[:, :, -s:], pad[1]).transpose(1, 2).reshape(b * s, value.shape[1], g.head_dim)
        q = _pad(query, pad[0]).transpose(1, 2).reshape(b * s, hq, g.head_dim)
        md = self.engine.metadata_for(layer_idx)
        try:
            res = layer.forward(q, k, v, md, model_inputs=model_inputs)
        except BaseException:
            if not self._driven:  # transformers-driven: no _run around the step to undo it
                self._abort_step(s, self._phase == "context")
            raise
        out = res.out[..., : self.value_dim]
        # dense = every position each new token has seen, eviction notwithstanding
        first = self._next_pos - s + 1
        dense = b * g.num_kv_heads * (s * first + s * (s - 1) // 2)
        # positions computed: skip-softmax's skipped tiles are attended in name only
        self._stats[self._phase][layer_idx] += (res.stats.computed_fraction * res.stats.dense, dense)
        if self.observers:
            result = replace(res, out=out)
            for observer in self.observers:
                observer(layer_idx, q, result, md, layer)
        if not self._driven and layer_idx == self.num_layers - 1:
            self._close_step()
        return out.reshape(b, s, hq, -1)

    # ---- reporting ----------------------------------------------------------------------
    def attended_fraction(self, phase: str = "generation") -> list[float | None]:
        """Per layer: positions attended / positions seen (all history, so evicted tokens count as
        skipped; positions in KV tiles that skip-softmax skipped count as skipped too), summed over
        the steps of ``phase`` since the last :meth:`reset_stats` (``None`` for a layer that saw no
        such step)."""
        if phase not in self._stats:
            raise ValueError(f"phase must be one of {sorted(self._stats)}, got {phase!r}")
        acc = self._stats[phase]
        return [float(a / n) if n else None for a, n in acc]

    def reset_stats(self) -> None:
        """Forget the attended fractions and the speculative acceptance gathered so far."""
        for acc in self._stats.values():
            acc[:] = 0
        if self._acceptance is not None:
            self._acceptance = AcceptanceStats.empty(self._acceptance.draft_len)
