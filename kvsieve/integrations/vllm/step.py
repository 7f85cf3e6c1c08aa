"""The per-step half of the plug-in, free of vLLM imports: one vLLM step's tables
(:class:`VllmStep`) translated once per step into kvsieve's
:class:`~kvsieve.metadata.AttentionMetadata` over a :class:`~kvsieve.metadata.ForeignPagedKV` view
(:class:`StepTranslator` -> :class:`PreparedStep`, shared by every layer of the step).

vLLM hands every attention layer of a step the same metadata object: ``query_start_loc [B+1]``,
``seq_lens [B]`` (tokens in the cache, this step's included), ``block_table [B, W]`` (physical
block ids) and ``num_actual_tokens``; prefill chunks and decode rows may be mixed in any order and
the step's K/V are already in the cache when attention runs. kvsieve wants context rows first.
A query token at a position before its request's prompt length is a *context* token (a prompt or a
chunk of one, attending its cached prefix and itself causally), every later one a *generation*
token: vLLM computes a request it preempted again as one prompt of its prompt and the tokens it
had generated, and those tokens are generation tokens, selected as their decode steps selected
them. So a vLLM row whose query crosses its prompt length is two kvsieve requests over the same
blocks, its prompt part (context) and its generated part (generation, several tokens). Every row's
prompt length is required (:func:`.request_settings.row_prompt_lens`, which refuses a step whose
rows it does not know; vLLM's own dummy steps build no metadata and never reach a translation:
:data:`.router.DUMMY_STEP`). The :class:`StepTranslator` splits and reorders rows (and their
tokens) context-first when needed, prepares the metadata once per step (not per layer), and maps
outputs back to vLLM's token order (:meth:`PreparedStep.to_vllm`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from ...metadata import AttentionMetadata
from ...metadata.foreign_paged import ForeignPagedKV
from .request_settings import RequestSetting, setting_ids
from .setting_groups import RequestsMetadata

__all__ = ["VllmStep", "StepTranslator", "PreparedStep"]


@dataclass(frozen=True)
class VllmStep:
    """What kvsieve reads of vLLM's step metadata, on the host: ``query_start_loc [B+1]``,
    ``seq_lens [B]``, ``block_table [B, W]`` (int32 numpy) and ``num_tokens`` (= the last query start);
    ``prompt_lens``: int32 ``[B]``, each row's request's prompt length (module docstring);
    ``settings``: each row's per-request setting (:mod:`.request_settings`; ``None`` entries the
    process default), or ``None`` when every row uses the process default; ``dense``: every row
    attends densely, the selectors keeping their state (a step vLLM runs itself under kvsieve's
    drafter, :mod:`.draft_steps`; :attr:`~kvsieve.metadata.AttentionMetadata.dense`); ``refresh_pages``:
    each row's newest page summary may hold keys of positions past the row (the first draft step of a
    round, :data:`.draft_steps.FIRST_DRAFT_STEP`): the one-call path recomputes it from the cache
    first (:meth:`.native_decode.NativeDecodeLayer.refresh_pages`); the selector's Python hooks do so
    anyway."""

    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray
    prompt_lens: np.ndarray
    settings: tuple[RequestSetting | None, ...] | None = None
    dense: bool = False
    refresh_pages: bool = False

    def __post_init__(self) -> None:
        b = self.seq_lens.shape[0]
        if self.prompt_lens.shape != (b,):
            raise ValueError(f"vLLM step: {self.prompt_lens.shape[0]} prompt lengths for {b} rows")

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @cached_property
    def context_tokens(self) -> np.ndarray:
        """int64 ``[B]``: how many of each row's query tokens (its first ones) are prompt tokens."""
        q_lens = np.diff(self.query_start_loc).astype(np.int64)
        first = self.seq_lens.astype(np.int64) - q_lens  # each row's first query position
        return np.clip(self.prompt_lens.astype(np.int64) - first, 0, q_lens)

    @cached_property
    def decode_only(self) -> bool:
        """Whether every row is one request's one new generated token and the step may take the
        one-call path (computed once per step)."""
        one_token = bool((np.diff(self.query_start_loc) == 1).all())
        return not self.dense and one_token and not self.context_tokens.any()

    @cached_property
    def positions(self) -> torch.Tensor:
        """int64 ``[B]``: each row's last position, ``seq_lens - 1`` (a decode row's new token)."""
        return torch.from_numpy(self.seq_lens.astype(np.int64) - 1)

    def same_as(self, other: VllmStep) -> bool:
        if (self.settings, self.dense, self.refresh_pages) != (other.settings, other.dense, other.refresh_pages):
            return False
        mine = (self.query_start_loc, self.seq_lens, self.block_table, self.prompt_lens)
        theirs = (other.query_start_loc, other.seq_lens, other.block_table, other.prompt_lens)
        return all(np.array_equal(a, b) for a, b in zip(mine, theirs))

    @classmethod
    def from_tensors(cls, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                     num_actual_tokens: int, prompt_lens: np.ndarray,
                     settings: tuple[RequestSetting | None, ...] | None = None, dense: bool = False,
                     refresh_pages: bool = False) -> VllmStep:
        b = seq_lens.shape[0]
        qsl = query_start_loc[: b + 1].cpu().numpy().astype(np.int32)
        step = cls(qsl, seq_lens.cpu().numpy().astype(np.int32), block_table[:b].cpu().numpy().astype(np.int32),
                   prompt_lens, settings, dense, refresh_pages)
        if step.num_tokens != num_actual_tokens:
            raise ValueError(f"vLLM step: query_start_loc ends at {step.num_tokens} but num_actual_tokens="
                             f"{num_actual_tokens}")
        if bool((step.seq_lens < np.diff(qsl)).any()):
            raise ValueError("vLLM step: a request has fewer cached tokens (seq_lens) than query tokens")
        return step


@dataclass(frozen=True)
class PreparedStep:
    """One vLLM step as kvsieve runs it, returned by :meth:`StepTranslator.prepare` and shared by the
    step's layers (valid until the translator prepares another step: the metadata objects are reused).
    ``metadata``: the step's requests, context first (a row crossing its prompt length is two);
    ``token_order``: int64 ``[T]``, kvsieve row ``t`` is vLLM token ``token_order[t]`` (``None``: the
    same order); ``row_settings``: each kvsieve request's setting (``None``: every row the process
    default); ``requests_metadata``: the metadata of a slice of the step's requests alone, over the
    same view (prepared once per step and slice, on first use)."""

    metadata: AttentionMetadata
    token_order: torch.Tensor | None
    row_settings: tuple[RequestSetting | None, ...] | None
    requests_metadata: RequestsMetadata

    @property
    def view(self) -> ForeignPagedKV:
        return self.metadata.kv_cache_manager

    def generation_metadata(self) -> AttentionMetadata:
        """The step's generation requests alone (rows ``[0, num_generation_tokens)`` = the step's
        :attr:`~AttentionMetadata.generation_rows`)."""
        return self.requests_metadata(self.metadata.phase_requests("generation"))

    def to_kvsieve(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of a ``[num_tokens, ...]`` tensor in kvsieve's (context-first) order."""
        return x if self.token_order is None else x[self.token_order.to(x.device)]

    def to_vllm(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Write kvsieve-ordered rows ``x`` into ``out`` in vLLM's token order."""
        if self.token_order is None:
            out.copy_(x)
        else:
            out[self.token_order.to(out.device)] = x


class StepTranslator:
    """One per process and KV-cache group: the view, the metadata, and the step it last prepared."""

    def __init__(self, view: ForeignPagedKV, *, max_num_tokens: int, translations: tuple[str, ...]) -> None:
        self.view = view
        self._metadata = AttentionMetadata(kv_cache_manager=view, max_num_requests=view.spec.max_requests,
                                           max_num_tokens=max_num_tokens, translations=translations)
        self._step: VllmStep | None = None
        self._prepared: PreparedStep | None = None
        self._parts: dict[tuple[int, int], AttentionMetadata] = {}  # slices of the step's requests, on demand
        self._spare: list[AttentionMetadata] = []  # metadata objects of earlier steps' slices, reused

    def prepare(self, step: VllmStep) -> PreparedStep:
        """The step prepared; the layers after the first of a step find it prepared (the metadata is a
        function of the step's tables, so equal tables reuse it). A row whose query crosses its prompt
        length becomes two requests (module docstring). Requests are ordered context first, then
        generation, and inside a phase by per-request setting (the default first), so each setting's
        rows are one slice (:mod:`.setting_groups`)."""
        if self._prepared is not None and (self._step is step or self._step.same_as(step)):
            return self._prepared
        qsl = step.query_start_loc.astype(np.int64)
        ctx = step.context_tokens
        gen = np.diff(qsl) - ctx
        ctx_rows, gen_rows = np.flatnonzero(ctx > 0), np.flatnonzero(gen > 0)
        if step.settings is not None:  # inside a phase by setting, then by row
            ids = setting_ids(step.settings)
            ctx_rows = ctx_rows[np.lexsort((ctx_rows, ids[ctx_rows]))]
            gen_rows = gen_rows[np.lexsort((gen_rows, ids[gen_rows]))]
        # the vLLM row of each kvsieve request; a row's prompt part comes before its generated part, so a
        # page both touch is summarized last over the longer prefix (a selector's on_append writes in order)
        rows = np.concatenate([ctx_rows, gen_rows])
        starts = np.concatenate([qsl[ctx_rows], qsl[gen_rows] + ctx[gen_rows]])  # its first query token
        counts = np.concatenate([ctx[ctx_rows], gen[gen_rows]])
        kv_lens = np.concatenate([step.seq_lens[ctx_rows] - gen[ctx_rows], step.seq_lens[gen_rows]])
        tok = np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
        self.view.set_batch(step.block_table[rows], kv_lens.astype(np.int32))
        md = self._metadata
        md.request_ids = list(range(rows.size))
        md.seq_lens = torch.from_numpy(counts.astype(np.int32))
        md.num_contexts = int(ctx_rows.size)
        md.dense = step.dense
        md.prepare()
        self._step = step
        self._spare.extend(self._parts.values())
        self._parts.clear()
        self._prepared = PreparedStep(
            md, None if np.array_equal(tok, np.arange(tok.size)) else torch.from_numpy(tok),
            None if step.settings is None else tuple(step.settings[i] for i in rows), self._requests_metadata)
        return self._prepared

    def _requests_metadata(self, requests: slice) -> AttentionMetadata:
        """The prepared step's requests ``requests`` (a slice of its rows) alone, as their own metadata
        over the same view; prepared once per step and slice, on first use."""
        key = (requests.start, requests.stop)
        if key not in self._parts:
            md = self._metadata
            part = self._spare.pop() if self._spare else AttentionMetadata(
                kv_cache_manager=self.view, max_num_requests=md.max_num_requests, max_num_tokens=md.max_num_tokens,
                translations=md.translations)
            part.request_ids = md.request_ids[requests]
            part.seq_lens = md.seq_lens[requests]
            part.num_contexts = max(0, min(md.num_contexts, requests.stop) - requests.start)
            part.dense = md.dense
            part.prepare()
            self._parts[key] = part
        return self._parts[key]
