"""A small step driver (the engine role: ledger, metadata, layers, evictions) used by tests, the demo and eval.

Cache groups: the engine takes one :class:`KVCacheManager` or several, each holding some layers
(``KVCacheSpec.layers``; a hybrid model's full-attention layers in one, its sliding-window layers
in another), each with its own ledger, lengths and :class:`AttentionMetadata`
(:meth:`Engine.metadata_for`). A group's layers share one sliding window or none. After each step
a windowed group drops the blocks wholly out of its window (as vLLM's sliding-window manager
does; ``release_windows=False`` keeps them), so its held blocks stay bounded; a group's layers may evict prompt tokens on their own (every
layer of that group alike), and its length then differs from the other groups'.

Requests may share blocks (see :mod:`kvsieve.metadata.kv_cache`): :meth:`Engine.add_request`
with the prompt's token ids reuses the longest cached prefix (the step then prefills only the
rest), :meth:`Engine.fork` starts a beam sharing every block of its parent, and ``end_step``
names the full blocks the step wrote so later requests can reuse them. The ledger copies a
shared block before a step writes it; before a step whose layers may evict, every block of its
context requests is made private (:meth:`KVCacheManager.make_writable`).

A step is all-or-nothing. ``begin_step`` checks the whole batch before it changes anything
(:meth:`Engine.check_batch`), snapshots what the step may write (ledger, allocator, the pool
rows of the batch's blocks, and each layer's record of the requests and blocks its selector has
seen, :class:`~.attention.SelectorRecord`), appends the step's tokens to the ledger, fills
:class:`AttentionMetadata` and runs ``prepare()``; the caller then runs its layers; ``end_step``
commits evictions and drops the snapshot, or ``abort_step`` puts the snapshot back. ``step``
does all of it for callers whose per-layer inputs are known up front and aborts on any error, so
a failed ``step`` leaves the ledger, the allocator, the pools and the selectors' records exactly
as before the call.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..metadata import AttentionMetadata, KVCacheManager, beam_rows
from ..metadata.kv_cache import CacheSnapshot
from .attention import LayerOutput, SelectorRecord, SparseAttention, commit_evictions
from .knobs import check_value

__all__ = ["Engine"]


class Engine:
    """Owns the metadata of a stack of :class:`SparseAttention` layers over one KV cache or several
    cache groups (see the module docstring)."""

    def __init__(self, cache: KVCacheManager | Sequence[KVCacheManager], layers: Sequence[SparseAttention], *,
                 max_num_requests: int, max_num_tokens: int, translations: Sequence[str] | None = None,
                 release_windows: bool = True) -> None:
        check_value("Engine.max_num_requests", max_num_requests, int, ge=1)
        check_value("Engine.max_num_tokens", max_num_tokens, int, ge=1)
        needed = sorted({t for layer in layers for t in layer.backend.required_translations})
        self.caches = [cache] if isinstance(cache, KVCacheManager) else list(cache)
        for layer in layers:  # an impossible backend for the caches' device or dtype: refused before any step
            for c in self.caches:
                layer.check_backend(layer.plan, device=c.spec.device, dtype=c.spec.dtype)
        self.layers = list(layers)
        group_of: dict[int, int] = {}
        for g, c in enumerate(self.caches):
            for i in c.spec.held_layers:
                if i in group_of:
                    raise ValueError(f"layer {i} is held by cache groups {group_of[i]} and {g}")
                group_of[i] = g
        missing = [layer.layer_idx for layer in self.layers if layer.layer_idx not in group_of]
        if missing:
            raise ValueError(f"layers {missing} are in no cache group")
        self._group = [group_of[layer.layer_idx] for layer in self.layers]
        self.windows: list[int | None] = []
        for g in range(len(self.caches)):
            ws = {layer.window for layer, lg in zip(self.layers, self._group) if lg == g}
            if len(ws) > 1:
                raise ValueError(f"cache group {g} holds layers with different sliding windows {sorted(ws, key=str)}; "
                                 "give each window its own group")
            self.windows.append(ws.pop() if ws else None)
        self.metadatas = [AttentionMetadata(kv_cache_manager=c, max_num_requests=max_num_requests,
                                            max_num_tokens=max_num_tokens,
                                            translations=translations if translations is not None else needed)
                          for c in self.caches]
        self.release_windows = release_windows
        self._snapshots: list[CacheSnapshot] | None = None
        self._records: list[SelectorRecord] = []  # each layer's, as the open step found it

    @property
    def cache(self) -> KVCacheManager:
        """The KV cache of a single-group engine."""
        return self.caches[self._single("cache")]

    @property
    def metadata(self) -> AttentionMetadata:
        """The step metadata of a single-group engine."""
        return self.metadatas[self._single("metadata")]

    def metadata_for(self, layer_idx: int) -> AttentionMetadata:
        """The step metadata of the cache group holding ``layer_idx``."""
        return self.metadatas[self._group[self._position(layer_idx)]]

    def _single(self, what: str) -> int:
        if len(self.caches) != 1:
            raise ValueError(f"Engine.{what}: this engine has {len(self.caches)} cache groups; use caches / "
                             "metadata_for(layer_idx)")
        return 0

    def _position(self, layer_idx: int) -> int:
        for i, layer in enumerate(self.layers):
            if layer.layer_idx == layer_idx:
                return i
        raise ValueError(f"no layer {layer_idx} in this engine")

    @property
    def request_ids(self) -> list[int]:
        return self.caches[0].request_ids

    def check_batch(self, request_ids: Sequence[int], seq_lens: Sequence[int], num_contexts: int,
                    tokens: Sequence[Sequence[int] | None] | None = None, beam_width: int = 1) -> list[int]:
        """Raise (changing nothing) unless the batch can run: ``request_ids`` unique ints,
        ``seq_lens`` ints >= 1 of the same length, ``0 <= num_contexts <= len(request_ids)``, the
        generation requests' rows whole groups of ``beam_width`` beams (:func:`~kvsieve.metadata.beam_rows`),
        every generation request (index >= ``num_contexts``) already prefilled, at most
        ``max_num_requests`` requests and ``max_num_tokens`` tokens, and room in every cache group
        (slots, blocks, ``max_blocks_per_seq``) for all appends together. Returns, per cache
        group, the number of blocks the step will allocate."""
        if len(request_ids) != len(seq_lens):
            raise ValueError(f"request_ids ({len(request_ids)}) and seq_lens ({len(seq_lens)}) must have the same length")
        for name, values in (("request_ids", request_ids), ("seq_lens", seq_lens)):
            for v in values:
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    raise TypeError(f"{name} entries must be ints, got {type(v).__name__} {v!r}")
        if isinstance(num_contexts, bool) or not isinstance(num_contexts, (int, np.integer)):
            raise TypeError(f"num_contexts must be an int, got {type(num_contexts).__name__} {num_contexts!r}")
        if not 0 <= num_contexts <= len(request_ids):
            raise ValueError(f"num_contexts must be in [0, {len(request_ids)}] (the number of requests), got {num_contexts}")
        beam_rows(np.arange(len(request_ids)), num_contexts, beam_width)
        bad = [(r, n) for r, n in zip(request_ids, seq_lens) if n < 1]
        if bad:
            raise ValueError(f"seq_lens must be >= 1 (new tokens per request); request {bad[0][0]} has {bad[0][1]}")
        md = self.metadatas[0]
        if len(request_ids) > md.max_num_requests:
            raise ValueError(f"{len(request_ids)} requests exceed max_num_requests={md.max_num_requests}")
        if sum(int(n) for n in seq_lens) > md.max_num_tokens:
            raise ValueError(f"seq_lens sum to {sum(int(n) for n in seq_lens)} tokens > max_num_tokens={md.max_num_tokens}")
        for rid in request_ids[num_contexts:]:
            if rid not in self.request_ids or self.caches[0].valid_len(rid) == 0:
                raise ValueError(f"generation request {rid} was never prefilled: put new requests among the first "
                                 f"num_contexts={num_contexts} (context) entries")
        if tokens is not None and len(tokens) != len(request_ids):
            raise ValueError(f"tokens: one entry (token ids or None) per request, got {len(tokens)} for "
                             f"{len(request_ids)} requests")
        for g in range(len(self.caches)):
            plans = [(layer.layer_idx, layer.plan is not None and layer.plan.selector.capabilities.evicts)
                     for layer, lg in zip(self.layers, self._group) if lg == g]
            if len({e for _, e in plans}) > 1:
                raise ValueError(f"cache group {g}: layers {[i for i, e in plans if e]} evict prompt tokens but layers "
                                 f"{[i for i, e in plans if not e]} do not; the layers of a group share one length")
        appends = [(int(r), int(n)) for r, n in zip(request_ids, seq_lens)]
        return [sum(c.blocks_to_copy(r) for r in self._rewritten(g, request_ids, num_contexts)) + c.check_appends(appends)
                for g, c in enumerate(self.caches)]

    def add_request(self, request_id: int, tokens: Sequence[int]) -> int:
        """Add a request tracked for prefix caching with its prompt ``tokens``; it starts holding
        the longest cached prefix (whole blocks, shared). Returns how many of ``tokens`` that is:
        prefill ``tokens[n:]`` next (``begin_step(..., tokens=[tokens[n:], ...])``). Refused on an
        engine with several cache groups (each would cache a different prefix)."""
        self._check_idle("add_request")
        self.caches[self._single("add_request (prefix caching)")].add_request(request_id, tokens=tokens)
        return self.caches[0].valid_len(request_id)

    def cached_prefix_len(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` :meth:`add_request` would find cached now; changes nothing."""
        return self.caches[self._single("cached_prefix_len (prefix caching)")].cached_prefix_len(tokens)

    def fork(self, parent_id: int, child_id: int) -> None:
        """Start request ``child_id`` as a beam of ``parent_id``: every block shared, copied on write."""
        self._check_idle("fork")
        self._all_groups(lambda c: c.fork(parent_id, child_id))

    def reorder(self, request_ids: Sequence[int], sources: Sequence[int]) -> None:
        """Beam reordering in every cache group (:meth:`KVCacheManager.reorder`)."""
        self._check_idle("reorder")
        self._all_groups(lambda c: c.reorder(request_ids, sources))

    def truncate(self, request_id: int, length: int) -> None:
        """Drop positions ``>= length`` of the request in every cache group."""
        self._check_idle("truncate")
        self._all_groups(lambda c: c.truncate(request_id, length))

    def free(self, request_id: int) -> None:
        self._check_idle("free")
        self._all_groups(lambda c: c.free_request(request_id))

    def _all_groups(self, op: Callable[[KVCacheManager], None]) -> None:
        """``op`` on every cache group, all or none: a group that raises puts the earlier ones back."""
        snaps = [c.snapshot() for c in self.caches] if len(self.caches) > 1 else None
        try:
            for c in self.caches:
                op(c)
        except BaseException:
            for c, snap in zip(self.caches, snaps or []):
                c.restore(snap)
            raise

    def _check_idle(self, caller: str) -> None:
        if self._snapshots is not None:
            raise RuntimeError(f"{caller}: a step is in progress; end or abort it first")

    def _rewritten(self, group: int, request_ids: Sequence[int], num_contexts: int) -> list[int]:
        """Requests of the step whose every block a layer of ``group`` may rewrite: the context
        requests already in the cache, when a layer's selector evicts (it compacts the whole prompt)."""
        evicts = any(layer.plan is not None and layer.plan.selector.capabilities.evicts
                     for layer, g in zip(self.layers, self._group) if g == group)
        return [int(r) for r in request_ids[:num_contexts] if evicts and r in self.caches[group].request_ids]

    def begin_step(self, request_ids: Sequence[int], seq_lens: Sequence[int], num_contexts: int,
                   tokens: Sequence[Sequence[int] | None] | None = None, beam_width: int = 1,
                   dense: bool = False) -> AttentionMetadata:
        """Context requests first. A request id not yet in the cache is added. ``tokens``: per
        request, the step's new token ids for a request tracked for prefix caching
        (:meth:`add_request`), ``None`` for the others. ``beam_width``: the generation requests
        come as groups of that many beams (forked requests, consecutive), laid out so in the
        block-offset table (:attr:`AttentionMetadata.beam_width`). ``dense``: every row of the step
        attends densely (:attr:`AttentionMetadata.dense`): each layer's selector runs ``on_append``
        (its per-position state follows the cache) but chooses nothing (a speculative verify pass,
        which must read what dense attention reads). Returns the step metadata of the first
        cache group (the only one of a single-group engine; every group's through
        :meth:`metadata_for`). Call :meth:`end_step` after the layers ran, or :meth:`abort_step`
        if one failed."""
        if self._snapshots is not None:
            raise RuntimeError("begin_step: the previous step was neither ended nor aborted")
        new_blocks = self.check_batch(request_ids, seq_lens, num_contexts, tokens, beam_width)
        self._snapshots = [c.snapshot(self._blocks_written(c, request_ids, num_contexts) + c.allocator.peek(n))
                           for c, n in zip(self.caches, new_blocks)]
        self._records = [layer.record() for layer in self.layers]
        try:
            for g, (c, md) in enumerate(zip(self.caches, self.metadatas)):
                for rid in self._rewritten(g, request_ids, num_contexts):
                    c.make_writable(rid)
                for i, (rid, n) in enumerate(zip(request_ids, seq_lens)):
                    if rid not in c.request_ids:
                        c.add_request(int(rid))
                    c.append_tokens(int(rid), int(n), None if tokens is None else tokens[i])
                md.request_ids = list(request_ids)
                md.seq_lens = list(seq_lens)
                md.num_contexts = num_contexts
                md.beam_width = beam_width
                md.dense = dense
                md.prepare()
        except BaseException:
            self.abort_step()
            raise
        return self.metadatas[0]

    def end_step(self) -> dict[int, int]:
        """Commit evictions recorded by the layers, drop the blocks out of each windowed group's
        window and name the full blocks written; returns request id -> kept length (of the group
        that evicted)."""
        done: dict[int, int] = {}
        try:
            for c, md, window in zip(self.caches, self.metadatas, self.windows):
                done.update(commit_evictions(md))
                if window is not None and self.release_windows:
                    for rid in md.request_ids:
                        c.release_before(rid, c.valid_len(rid) + 1 - window)
                c.cache_full_blocks(md.request_ids)
        except BaseException:
            self.abort_step()
            raise
        self._snapshots = None
        self._records = []
        return done

    def abort_step(self) -> None:
        """Undo the step begun by :meth:`begin_step`: ledger, allocator and the pool rows it may
        have written (main and auxiliary pools) are restored in every group, and each layer's
        record of what its selector has seen; recorded evictions are dropped."""
        if self._snapshots is None:
            raise RuntimeError("abort_step: no step in progress")
        for c, md, snap in zip(self.caches, self.metadatas, self._snapshots):
            c.restore(snap)
            md.pending_kv_lens.clear()
            md.prepared = False
        for layer, record in zip(self.layers, self._records):
            layer.restore_record(record)
        self._snapshots = None
        self._records = []

    def step(self, request_ids: Sequence[int], seq_lens: Sequence[int], num_contexts: int,
             layer_inputs: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
             model_inputs: Sequence[object] | None = None, tokens: Sequence[Sequence[int] | None] | None = None
             ) -> list[LayerOutput]:
        """One whole step; on any error the cache is left exactly as before the call. ``tokens``:
        as for :meth:`begin_step`.

        ``model_inputs``: one entry per layer (``None`` where the layer's selector reads none),
        passed to :meth:`SparseAttention.forward` as this step's per-step model inputs."""
        if len(layer_inputs) != len(self.layers):
            raise ValueError(f"expected inputs for {len(self.layers)} layers, got {len(layer_inputs)}")
        if model_inputs is None:
            model_inputs = [None] * len(self.layers)
        elif len(model_inputs) != len(self.layers):
            raise ValueError(f"expected model_inputs for {len(self.layers)} layers (None where a layer's selector "
                             f"reads none), got {len(model_inputs)}")
        self.check_batch(request_ids, seq_lens, num_contexts, tokens)
        num_tokens = sum(int(n) for n in seq_lens)
        for i, inputs in enumerate(layer_inputs):
            for name, t in zip(("q", "k", "v"), inputs):
                if t is None:
                    continue
                if not t.is_floating_point():
                    raise TypeError(f"layer {i}: {name} must be a floating-point tensor, got {t.dtype}")
                if t.dim() < 2 or t.shape[0] != num_tokens:
                    raise ValueError(f"layer {i}: {name} must have num_tokens={num_tokens} rows (sum of seq_lens), "
                                     f"got shape {tuple(t.shape)}")
        self.begin_step(request_ids, seq_lens, num_contexts, tokens)
        try:
            outs = [layer.forward(q, k, v, self.metadatas[g], model_inputs=extra)
                    for layer, g, (q, k, v), extra in zip(self.layers, self._group, layer_inputs, model_inputs)]
        except BaseException:
            self.abort_step()
            raise
        self.end_step()
        return outs

    @staticmethod
    def _blocks_written(cache: KVCacheManager, request_ids: Sequence[int], num_contexts: int) -> list[int]:
        """Blocks held before the step that it may write: every block of a context request
        (eviction compacts the whole prompt) and, for a generation request, the block holding its
        first new position (later positions land in blocks this step allocates)."""
        p = cache.tokens_per_block
        blocks: list[int] = []
        for i, rid in enumerate(request_ids):
            if rid not in cache.request_ids:
                continue
            held = cache.block_ids(rid)
            first = cache.valid_len(rid) // p
            blocks += held if i < num_contexts else held[first:]
        return blocks
