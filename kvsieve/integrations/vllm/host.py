"""The host engine's own attention, for the rows the plug-in leaves to it (free of vLLM imports).

Rows a layer attends densely (dense layers, ``dense`` mode, the prompt rows of a plan that selects
only in the generation phase) run the host's own kernel on the host's own step metadata and cache:
no gather, no translation (:meth:`HostAttention.dense`). A page selection whose pages are the
host's cache blocks is, per (generation row, KV head), a shorter block table: the host's paged
kernel reads the selected blocks in place when the cache is seen as ``[num_blocks * Hkv, 1,
block_size, ...]`` (block ``b`` of KV head ``h`` is pseudo-block ``b * Hkv + h``) and every
(row, KV head) is a pseudo-request of its ``G`` query heads and one KV head
(:func:`per_head_block_tables`, :meth:`HostAttention.paged_per_head`).

Any other position selection of generation rows (token-granular: ``oracle_topk``, ``streaming``,
third-party token selectors; pages smaller than a cache block; a whole-block selection where a
(row, KV head) selects nothing) is turned into per-(row, KV head) runs of consecutive positions
inside one cache block, and kvsieve's native decode kernel reads them in place from the host's
cache views (:func:`token_runs`, :func:`native_runs_attention`; K stored by channel, as in vLLM's
CPU layout, is read channel by channel). Prompt rows that select positions (DSA in the prompt) take
the same runs through the tiled prompt kernel, which reads each block once for a tile of rows.

A verify pass of lossless decoding (a dense step under kvsieve's drafter whose requests have at most
:data:`VERIFY_MAX_TOKENS` query tokens each: ``K + 1`` verified positions, or one) takes kvsieve's
causal-rows kernel (:func:`verify_pass`, :func:`causal_attention`): a request's rows are folded into
one query group, so its context is read once, where the host's CPU kernel reads it once per query row
(``K + 1`` times; docs/lossless.md, "In vLLM").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ...kernels.causal_rows.native import SOURCE as CAUSAL_SOURCE
from ...kernels.causal_rows.native import causal_rows_native, supports_causal_rows
from ...kernels.common.native import native_status
from ...kernels.head_tables.plan import head_tables
from ...kernels.prompt_runs.native import SOURCE as PROMPT_SOURCE
from ...kernels.prompt_runs.native import prompt_runs_native
from ...kernels.sparse_gqa_decode.native import SOURCE, sparse_decode_runs_native, supports_runs_native
from ...kernels.sparse_gqa_decode.runs import TokenRuns, selection_runs
from ...metadata import AttentionMetadata
from ...metadata.foreign_paged import ForeignPagedKV
from ...sparse import AttentionGeometry, SparseRuntimeParams

__all__ = ["VERIFY_MAX_TOKENS", "HostAttention", "PerHeadTables", "causal_attention", "native_runs_attention",
           "per_head_block_tables", "runs_kernel_takes", "token_runs", "verify_pass"]

#: the most query tokens of a request in a verify pass (vLLM's ``num_speculative_tokens`` <= 128, plus one)
VERIFY_MAX_TOKENS = 129


class HostAttention(Protocol):
    """One layer call's host kernels (the host binds the layer, the step and the cache)."""

    def dense(self) -> torch.Tensor:
        """The host's own attention of the whole step: ``[T, Hq, D]`` in the host's token order
        (computed once per layer call; later calls return the same tensor)."""

    def paged_per_head(self, q: torch.Tensor, tables: PerHeadTables) -> torch.Tensor:
        """q ``[N * Hkv, G, D]`` (generation row ``n``, KV head ``h`` at ``n * Hkv + h``: a reshape of
        ``[N, Hq, D]``) -> ``[N * Hkv, G, D]``: each pseudo-request attends the first
        ``tables.seq_lens[i]`` positions of the pseudo-blocks ``tables.block_table[i]``."""


@dataclass(frozen=True)
class PerHeadTables:
    """``block_table [N * Hkv, K]`` int32 pseudo-block ids (``block * Hkv + head``; entries past a
    row's blocks are 0 and not read), ``seq_lens [N * Hkv]`` int32 positions attended (every block
    full but the last, which is the request's newest block when it is partial)."""

    block_table: torch.Tensor
    seq_lens: torch.Tensor


def per_head_block_tables(params: SparseRuntimeParams, md: AttentionMetadata, view: ForeignPagedKV
                          ) -> PerHeadTables | None:
    """The generation rows' block selection of ``params`` as per-(row, KV head) tables of pseudo-block
    ids (module docstring; built by :func:`kvsieve.kernels.head_tables.plan.head_tables`), or ``None``
    when the selection is not whole cache blocks (``sparse_attn_indices_block_size`` other than the
    cache's block size) or some (row, KV head) selects nothing (the caller then takes kvsieve's
    backend). ``params`` validated; ``md`` is the step's metadata over ``view``; each generation row
    attends its causal length ``position + 1``."""
    bs = view.tokens_per_block
    if params.sparse_attn_indices_block_size != bs or not params.selects_positions("generation"):
        return None
    rows = md.generation_rows
    reqs = md.token_to_req_host[rows]  # a request may have several generation rows (a recomputed one)
    off = params.sparse_attn_offsets.numpy()[rows.start: rows.stop + 1]  # the rows' segments (host numpy)
    idx = params.sparse_attn_indices.numpy()[:, off[0]: off[-1]]
    built = head_tables(idx, off - off[0], view.block_table[md.slots[reqs]], md.positions_host[rows] + 1, bs)
    if built is None:
        return None
    return PerHeadTables(torch.from_numpy(built[0]), torch.from_numpy(built[1]))


def token_runs(params: SparseRuntimeParams, md: AttentionMetadata, view: ForeignPagedKV,
               rows: slice | None = None) -> TokenRuns | None:
    """The position selection of ``params`` (any ``sparse_attn_indices_block_size``) for the query
    rows ``rows`` (default: the generation rows; context rows too, each token with its own causal
    length ``position + 1``) as per-(row, KV head) runs of consecutive positions inside one cache block
    (:func:`kvsieve.kernels.sparse_gqa_decode.runs.selection_runs`, in row order), or ``None`` when
    those rows' phase selects no positions. ``params`` validated."""
    rows = md.generation_rows if rows is None else rows
    phase = "generation" if rows.start >= md.generation_rows.start else "context"
    if not params.selects_positions(phase):
        return None
    off = params.sparse_attn_offsets.numpy()[rows.start: rows.stop + 1]
    idx = params.sparse_attn_indices.numpy()[:, off[0]: off[-1]]
    reqs = md.token_to_req_host[rows]
    return selection_runs(idx, off - off[0], params.sparse_attn_indices_block_size, view.block_table[md.slots[reqs]],
                          md.positions_host[rows] + 1, view.tokens_per_block)


def runs_kernel_takes(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, geometry: AttentionGeometry) -> bool:
    """Whether kvsieve's native runs kernel takes a layer call: ``k``/``v [num_blocks, Hkv, block_size,
    D]`` the layer's cache views, q ``[N, Hq, D]``: GQA with ``value_dim == head_dim``, a cache dtype of
    bf16/fp32, a head dim up to 256 and a group up to 16 (:func:`supports_runs_native`), and its
    library there (``KVSIEVE_NATIVE=0`` or no compiler: not)."""
    return (geometry.kind == "gqa" and geometry.value_dim == geometry.head_dim and supports_runs_native(k, v, q)
            and native_status(SOURCE) == "native")


def native_runs_attention(q: torch.Tensor, runs: TokenRuns, view: ForeignPagedKV, layer_idx: int,
                          geometry: AttentionGeometry, *, prompt: bool = False) -> torch.Tensor:
    """q ``[N, Hq, D]`` (the rows of ``runs``) -> ``[N, Hq, D]`` in q's dtype: each (row, KV head)
    attends its runs, read in place from the view's K/V of ``layer_idx`` by a native kernel: the decode
    kernel, or for ``prompt`` rows (consecutive rows of prompts, selecting mostly the same blocks) the
    tiled prompt kernel (:mod:`kvsieve.kernels.prompt_runs`) where its library loads; the caller has
    checked :func:`runs_kernel_takes`."""
    k, v = view.k_cache(layer_idx), view.v_cache(layer_idx)
    tiled = prompt and native_status(PROMPT_SOURCE) == "native"
    kernel = prompt_runs_native if tiled else sparse_decode_runs_native
    out, _ = kernel(k, v, runs, q, sm_scale=geometry.sm_scale)
    return out.to(q.dtype)


def verify_pass(md: AttentionMetadata, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor,
                geometry: AttentionGeometry) -> bool:
    """Whether a step's dense attention takes :func:`causal_attention`: a dense step (``md.dense``, a
    step vLLM runs itself under kvsieve's drafter) whose requests have at most
    :data:`VERIFY_MAX_TOKENS` query tokens each (a prompt chunk keeps the host's own kernel), a GQA
    layer over views ``k``/``v`` the causal-rows kernel takes, with its library there."""
    return (md.dense and md.num_seqs > 0 and int(np.diff(md.query_start_host).max()) <= VERIFY_MAX_TOKENS
            and geometry.kind == "gqa" and geometry.value_dim == geometry.head_dim
            and supports_causal_rows(k, v, q) and native_status(CAUSAL_SOURCE) == "native")


def causal_attention(q: torch.Tensor, md: AttentionMetadata, view: ForeignPagedKV, layer_idx: int,
                     geometry: AttentionGeometry) -> torch.Tensor:
    """q ``[T, Hq, D]`` (the step's rows, kvsieve order: each request's rows together, its last
    positions) -> ``[T, Hq, D]`` in q's dtype: each row's dense causal attention (positions ``[0,
    position + 1)`` of its request, this step's K/V already in the cache) by the causal-rows kernel
    (:mod:`kvsieve.kernels.causal_rows`), which reads each request's blocks once for all its rows."""
    out, _ = causal_rows_native(view.k_cache(layer_idx), view.v_cache(layer_idx), view.block_table[md.slots],
                                md.query_start_host, md.kv_lens_host, q, sm_scale=geometry.sm_scale)
    return out.to(q.dtype)
