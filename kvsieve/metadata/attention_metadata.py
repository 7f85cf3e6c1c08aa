"""``AttentionMetadata``: the per-step contract between the engine, selectors and backends.

Capacity (``max_num_requests``, ``max_num_tokens``, ``max_num_sequences``) is fixed at
construction; every per-row buffer is allocated to capacity once and only its first rows are
written each step, in place (``copy_``), so a captured CUDA graph keeps valid addresses.

Per step the engine sets ``request_ids`` (context requests first), ``seq_lens`` (new query
tokens per request), ``num_contexts`` and ``beam_width`` (the generation requests' rows come in
groups of ``beam_width`` beams, each beam a request of its own; 1 without beam search), appends the step's tokens to the ledger
(:meth:`KVCacheManager.append_tokens`), then calls :meth:`prepare` once; ``prepare`` asks the
manager for block ids and lengths through the request ids and fills the translations the
backends asked for.

Phases: the first ``num_contexts`` requests are the context (prefill) phase, the rest the
generation (decode) phase. Their query tokens are contiguous, context first:
:attr:`AttentionMetadata.context_rows` and :attr:`AttentionMetadata.generation_rows` are the two
token-row slices, :meth:`AttentionMetadata.phase_rows` / :meth:`AttentionMetadata.phase_requests`
the slices of one phase, :meth:`AttentionMetadata.phases` the phases present this step.

Translations (each has a reader): ``block_lists`` (Vanilla), ``ragged_page_table`` (torch),
``block_offsets`` (Triton and CuTe GQA).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .block_lists import BlockLists, build_block_lists
from .block_offsets import BlockOffsetTable, beam_rows
from .kv_cache import KVCacheManager
from .ragged_page_table import RaggedPageTable

__all__ = ["AttentionMetadata", "TRANSLATIONS", "PHASES"]

TRANSLATIONS = ("block_lists", "ragged_page_table", "block_offsets")
PHASES = ("context", "generation")


class AttentionMetadata:
    """Step metadata with preallocated host and device buffers."""

    def __init__(
        self,
        *,
        kv_cache_manager: KVCacheManager,
        max_num_requests: int,
        max_num_tokens: int,
        max_num_sequences: int | None = None,
        translations: Sequence[str] = ("block_lists",),
        device: str | torch.device | None = None,
    ) -> None:
        unknown = [t for t in translations if t not in TRANSLATIONS]
        if unknown:
            raise ValueError(f"translations: unknown {unknown}; known: {list(TRANSLATIONS)}")
        if max_num_requests < 1 or max_num_tokens < 1:
            raise ValueError("max_num_requests and max_num_tokens must be >= 1")
        self.kv_cache_manager = kv_cache_manager
        self.max_num_requests = max_num_requests
        self.max_num_tokens = max_num_tokens
        self.max_num_sequences = max_num_sequences or max_num_requests
        self.translations = tuple(translations)
        self.device = torch.device(device if device is not None else kv_cache_manager.spec.device)
        dev, r, t = self.device, max_num_requests, max_num_tokens
        spec = kv_cache_manager.spec

        def ibuf(n: int, *shape: int) -> torch.Tensor:
            return torch.zeros((n, *shape), dtype=torch.int32, device=dev)

        self._seq_lens_host = torch.zeros(r, dtype=torch.int32)
        self._seq_lens_view = self._seq_lens_host[:0]
        self._kv_lens_host = np.zeros(r, dtype=np.int32)
        self._kv_lens_device = ibuf(r)
        self._token_to_req = ibuf(t)
        self._positions = ibuf(t)
        self._token_kv_lens = ibuf(t)
        self._positions_host = np.zeros(t, dtype=np.int32)
        self._token_to_req_host = np.zeros(t, dtype=np.int32)
        self._table_width = 0
        self._query_start_host = np.zeros(r + 1, dtype=np.int32)
        self._block_table_device = ibuf(r, spec.max_blocks_per_seq)
        self.ragged_page_table = (
            RaggedPageTable(r, t, r * spec.max_blocks_per_seq, dev) if "ragged_page_table" in translations else None
        )
        self.block_offset_table = (
            BlockOffsetTable(self.max_num_sequences, spec.max_blocks_per_seq, dev)
            if "block_offsets" in translations else None
        )
        self.block_ids_per_seq: BlockLists = build_block_lists(kv_cache_manager.block_table,
                                                                kv_cache_manager.num_blocks_of, np.zeros(0, np.int32))
        self._request_ids: list[int] = []
        self._num_seqs = 0
        self._num_contexts = 0
        self._beam_width = 1
        self.num_tokens = 0
        self.num_ctx_tokens = 0
        self.num_generations = 0
        self.slots = np.zeros(0, dtype=np.int32)
        self.prepared = False
        # request id -> kept length after eviction, recorded by layers, committed by the engine
        self.pending_kv_lens: dict[int, int] = {}
        # a step whose every row attends densely: the selectors keep their state (on_append) but
        # choose nothing (a speculative verify pass, kvsieve.integrations.transformers.speculate)
        self.dense = False

    # ---- per-step inputs (setters recompute the derived counts) ---------------------------
    @property
    def request_ids(self) -> list[int]:
        return self._request_ids

    @request_ids.setter
    def request_ids(self, ids: Sequence[int]) -> None:
        if len(ids) > self.max_num_requests:
            raise ValueError(f"request_ids: {len(ids)} requests exceed max_num_requests={self.max_num_requests}")
        self._request_ids = [int(i) for i in ids]
        self.prepared = False

    @property
    def seq_lens(self) -> torch.Tensor:
        """Host int32 ``[num_seqs]``: new query tokens per request this step."""
        return self._seq_lens_view

    @seq_lens.setter
    def seq_lens(self, lens: torch.Tensor | Sequence[int]) -> None:
        lens = torch.as_tensor(lens, dtype=torch.int32).cpu()
        n = lens.numel()
        if lens.dim() != 1 or n > self.max_num_requests:
            raise ValueError(f"seq_lens must be 1-D with at most {self.max_num_requests} entries, got {tuple(lens.shape)}")
        if n and int(lens.min()) < 0:
            raise ValueError("seq_lens entries must be >= 0")
        total = int(lens.sum())
        if total > self.max_num_tokens:
            raise ValueError(f"seq_lens sum to {total} tokens > max_num_tokens={self.max_num_tokens}")
        self._seq_lens_host[:n].copy_(lens)
        self._num_seqs = n
        self._seq_lens_view = self._seq_lens_host[:n]
        self._update_counts()

    @property
    def num_contexts(self) -> int:
        return self._num_contexts

    @num_contexts.setter
    def num_contexts(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"num_contexts must be >= 0, got {n}")
        self._num_contexts = int(n)
        self._update_counts()

    @property
    def beam_width(self) -> int:
        """Rows per generation request: its beams, consecutive (the block-offset table's layout)."""
        return self._beam_width

    @beam_width.setter
    def beam_width(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"beam_width must be an int >= 1, got {n!r}")
        self._beam_width = int(n)
        self.prepared = False

    @property
    def num_seqs(self) -> int:
        return self._num_seqs

    def _update_counts(self) -> None:
        lens = self._seq_lens_host[: self._num_seqs]
        c = min(self._num_contexts, self._num_seqs)
        self.num_tokens = int(lens.sum())
        self.num_ctx_tokens = int(lens[:c].sum())
        self.num_generations = self._num_seqs - c
        self.prepared = False

    # ---- prepare ---------------------------------------------------------------------------
    def prepare(self) -> None:
        """Host-side work of the step: look up the ledger, fill the tables, copy in place."""
        if len(self._request_ids) != self._num_seqs:
            raise ValueError(
                f"request_ids has {len(self._request_ids)} entries but seq_lens has {self._num_seqs}"
            )
        if self._num_contexts > self._num_seqs:
            raise ValueError(f"num_contexts={self._num_contexts} > number of requests {self._num_seqs}")
        mgr = self.kv_cache_manager
        slots = mgr.slots(self._request_ids)
        beam_rows(slots, self._num_contexts, self._beam_width)  # whole beam groups, before anything is written
        b = len(slots)
        seq = self._seq_lens_host[:b].numpy()
        kv = mgr.valid_lens[slots]
        if bool((kv < seq).any()):
            raise ValueError("prepare: a request has fewer cached tokens than this step's seq_lens; "
                             "append the step's tokens to the KV cache before prepare()")
        self.slots = slots
        self._kv_lens_host[:b] = kv
        self._kv_lens_device[:b].copy_(torch.from_numpy(kv), non_blocking=True)
        qs = self._query_start_host
        qs[0] = 0
        np.cumsum(seq, out=qs[1 : b + 1])
        n = int(qs[b])
        token_req = np.repeat(np.arange(b, dtype=np.int32), seq)
        positions = (np.repeat(kv - seq, seq) + np.arange(n, dtype=np.int32) - np.repeat(qs[:b], seq)).astype(np.int32)
        self._positions_host[:n] = positions
        self._token_to_req_host[:n] = token_req
        self._token_to_req[:n].copy_(torch.from_numpy(token_req), non_blocking=True)
        self._positions[:n].copy_(torch.from_numpy(positions), non_blocking=True)
        self._token_kv_lens[:n].copy_(torch.from_numpy(positions + 1), non_blocking=True)
        width = int(mgr.num_blocks_of[slots].max()) if b else 0
        self._block_table_device[:b, :width].copy_(torch.from_numpy(mgr.block_table[slots, :width]), non_blocking=True)
        self._table_width = width
        if "block_lists" in self.translations:
            self.block_ids_per_seq = build_block_lists(mgr.block_table, mgr.num_blocks_of, slots)
        if self.ragged_page_table is not None:
            self.ragged_page_table.fill(mgr.block_table, slots, kv, seq, mgr.tokens_per_block)
        if self.block_offset_table is not None:
            speculative = bool((mgr.addressable_lens[slots] > kv).any())
            self.block_offset_table.fill(mgr.block_table, slots, mgr.num_blocks_of, speculative,
                                         num_contexts=self._num_contexts, beam_width=self._beam_width)
        self.prepared = True

    # ---- per-step outputs of prepare -------------------------------------------------------
    @property
    def kv_lens(self) -> torch.Tensor:
        """Device int32 ``[num_seqs]``: valid (committed) tokens per request, this step included."""
        return self._kv_lens_device[: self._num_seqs]

    @property
    def kv_lens_host(self) -> np.ndarray:
        return self._kv_lens_host[: self._num_seqs]

    @property
    def cached_lens_host(self) -> np.ndarray:
        """Host ``[num_seqs]``: tokens each request held before this step (``kv_lens - seq_lens``)."""
        return self.kv_lens_host - np.diff(self.query_start_host)

    @property
    def query_start_host(self) -> np.ndarray:
        """Host int32 ``[num_seqs + 1]``: prefix sum of :attr:`seq_lens`."""
        return self._query_start_host[: self._num_seqs + 1]

    @property
    def token_to_req(self) -> torch.Tensor:
        """Device int32 ``[num_tokens]``: batch row of each query token."""
        return self._token_to_req[: self.num_tokens]

    @property
    def positions(self) -> torch.Tensor:
        """Device int32 ``[num_tokens]``: request-local position of each query token."""
        return self._positions[: self.num_tokens]

    @property
    def positions_host(self) -> np.ndarray:
        return self._positions_host[: self.num_tokens]

    @property
    def token_to_req_host(self) -> np.ndarray:
        return self._token_to_req_host[: self.num_tokens]

    @property
    def token_kv_lens(self) -> torch.Tensor:
        """Device int32 ``[num_tokens]``: positions each query may attend (causal: position + 1)."""
        return self._token_kv_lens[: self.num_tokens]

    @property
    def block_table(self) -> torch.Tensor:
        """Device int32 ``[num_seqs, width]``: physical block of each logical page (0 = pad)."""
        return self._block_table_device[: self._num_seqs, : max(self._table_width, 1)]

    def is_context(self, i: int) -> bool:
        """Whether batch row ``i`` is a context (prefill) request."""
        return i < self._num_contexts

    def require(self, reader: str, translations: Sequence[str]) -> None:
        """Raise ``ValueError`` naming ``reader`` and the missing ones unless every translation in
        ``translations`` is built by :meth:`prepare` (constructor argument ``translations``)."""
        missing = [t for t in translations if t not in self.translations]
        if missing:
            raise ValueError(f"{reader} needs metadata translations {missing}; this AttentionMetadata builds "
                             f"{list(self.translations)} (constructor argument translations=)")

    # ---- phases ----------------------------------------------------------------------------
    @property
    def context_rows(self) -> slice:
        """Query-token rows ``[0, num_ctx_tokens)`` of the context (prefill) requests."""
        return slice(0, self.num_ctx_tokens)

    @property
    def generation_rows(self) -> slice:
        """Query-token rows ``[num_ctx_tokens, num_tokens)`` of the generation (decode) requests."""
        return slice(self.num_ctx_tokens, self.num_tokens)

    def phase_rows(self, phase: str) -> slice:
        """Query-token rows of ``phase`` (``"context"`` or ``"generation"``)."""
        return self.context_rows if _phase(phase) == "context" else self.generation_rows

    def phase_requests(self, phase: str) -> slice:
        """Batch rows (requests) of ``phase``: ``[0, num_contexts)`` or ``[num_contexts, num_seqs)``."""
        c = min(self._num_contexts, self._num_seqs)
        return slice(0, c) if _phase(phase) == "context" else slice(c, self._num_seqs)

    def phases(self) -> tuple[str, ...]:
        """The phases with at least one query token this step, context first."""
        ctx, gen = self.num_ctx_tokens > 0, self.num_tokens > self.num_ctx_tokens
        return ("context",) * ctx + ("generation",) * gen


def _phase(phase: str) -> str:
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {list(PHASES)}, got {phase!r}")
    return phase
