"""What one decode layer call runs: the program a selector hands the kernel (``decode_layer.c``'s
header lists the rules) and the per-step inputs of the indexer program; checked on construction."""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KINDS", "MODES", "DecodeProgram", "IndexerStep"]

KINDS = {"pages": 1, "streaming": 2, "tokens_exact": 3, "blocks_exact": 4, "blocks_bound": 5, "indexer": 6}
MODES = {None: 0, "bound": 0, "sign": 1, "max": 0, "mean": 1}
_KIND_MODES = {"pages": ("bound", "sign"), "blocks_exact": ("max", "mean")}  # the others take none


@dataclass(frozen=True)
class DecodeProgram:
    """What a selector does on a decode row, as the kernel runs it (``decode_layer.c``'s header).

    ``kind``: one of :data:`KINDS`; ``units`` kept per (row, KV head) at most, each ``unit``
    positions (page size, block size, or 1); ``mode``: ``"bound"``/``"sign"`` (pages), ``"max"``/
    ``"mean"`` (exact blocks); ``num_sink`` (streaming); ``init_units``/``local_units`` forced blocks;
    ``pool``: the layer's page-summary pool ``[num_blocks, Hkv, S, 2, D]`` (bf16 or fp32; pages of
    ``page_size`` tokens, ``S`` per cache block), for ``pages`` and ``blocks_bound``; ``index_keys``:
    the layer's indexer key pool ``[num_blocks, block_size, index_dim]`` (bf16 or fp32), for
    ``indexer``, whose per-step inputs come with each call (:class:`IndexerStep`)."""

    kind: str
    units: int
    unit: int = 1
    mode: str | None = None
    num_sink: int = 0
    init_units: int = 0
    local_units: int = 0
    pool: torch.Tensor | None = None
    page_size: int = 0
    index_keys: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"decode program kind must be one of {sorted(KINDS)}, got {self.kind!r}")
        modes = _KIND_MODES.get(self.kind, (None,))
        if self.mode not in modes:  # a mode another kind takes would be read as this kind's (same code)
            raise ValueError(f"decode program {self.kind!r} takes mode {' or '.join(map(repr, modes))}, "
                             f"got {self.mode!r}")
        needs = {"pages": "pool", "blocks_bound": "pool", "indexer": "index_keys"}.get(self.kind)
        if needs is not None and getattr(self, needs) is None:
            raise ValueError(f"decode program {self.kind!r} needs {needs}")
        if needs == "pool" and self.page_size < 1:
            raise ValueError(f"decode program {self.kind!r} needs page_size >= 1 (its pool's pages), got {self.page_size}")


@dataclass(frozen=True)
class IndexerStep:
    """An ``indexer`` program's inputs for one step's ``N`` rows, fp32 contiguous: ``q [N, H, Di]``
    index queries (already rounded to the key pool's dtype), ``weights [N, H]``, ``keys [N, Di]``
    the rows' own index keys (written into the pool at their positions)."""

    q: torch.Tensor
    weights: torch.Tensor
    keys: torch.Tensor
