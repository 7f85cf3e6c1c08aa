"""The host engine's own attention, for the rows the plug-in leaves to it (free of vLLM imports).

Rows a layer attends densely (dense layers, ``dense`` mode, the prompt rows of a plan that selects
only in the generation phase) run the host's own kernel on the host's own step metadata and cache:
no gather, no translation (:meth:`HostAttention.dense`). A page selection whose pages are the
host's cache blocks is, per (generation row, KV head), a shorter block table: the host's paged
kernel reads the selected blocks in place when the cache is seen as ``[num_blocks * Hkv, 1,
block_size, ...]`` (block ``b`` of KV head ``h`` is pseudo-block ``b * Hkv + h``) and every
(row, KV head) is a pseudo-request of its ``G`` query heads and one KV head
(:func:`per_head_block_tables`, :meth:`HostAttention.paged_per_head`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ...kernels.cpu.head_tables import head_tables
from ...metadata import AttentionMetadata
from ...metadata.foreign_paged import ForeignPagedKV
from ...sparse import SparseRuntimeParams

__all__ = ["HostAttention", "PerHeadTables", "per_head_block_tables"]


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
    ids (module docstring; built by :func:`kvsieve.kernels.cpu.head_tables.head_tables`), or ``None``
    when the selection is not whole cache blocks (``sparse_attn_indices_block_size`` other than the
    cache's block size) or some (row, KV head) selects nothing (the caller then takes kvsieve's
    backend). ``params`` validated; ``md`` is the step's metadata over ``view``; every generation
    row is one request's one token."""
    bs = view.tokens_per_block
    if params.sparse_attn_indices_block_size != bs or not params.selects_positions("generation"):
        return None
    rows, reqs = md.generation_rows, md.phase_requests("generation")
    off = params.sparse_attn_offsets.numpy()[rows.start: rows.stop + 1]  # the rows' segments (host numpy)
    idx = params.sparse_attn_indices.numpy()[:, off[0]: off[-1]]
    built = head_tables(idx, off - off[0], view.block_table[md.slots[reqs]], md.kv_lens_host[reqs], bs)
    if built is None:
        return None
    return PerHeadTables(torch.from_numpy(built[0]), torch.from_numpy(built[1]))
