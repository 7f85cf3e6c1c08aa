"""The backend interface: compute attention over exactly the selected set; report its cost."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from ...metadata import AttentionMetadata
from ..params import SparseRuntimeParams
from ..selection import attended_counts

__all__ = ["AttentionGeometry", "AttentionBackend"]


@dataclass(frozen=True)
class AttentionGeometry:
    """Shapes of one attention layer. MLA (absorbed): q width ``kv_lora_rank + rope_dim``,
    one latent KV head, output width ``kv_lora_rank``."""

    kind: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    sm_scale: float
    kv_lora_rank: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("gqa", "mla"):
            raise ValueError(f"AttentionGeometry.kind must be 'gqa' or 'mla', got {self.kind!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads={self.num_q_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.kind == "mla" and (self.num_kv_heads != 1 or not 0 < self.kv_lora_rank <= self.head_dim):
            raise ValueError("MLA geometry needs num_kv_heads=1 and 0 < kv_lora_rank <= head_dim")

    @property
    def value_dim(self) -> int:
        return self.kv_lora_rank if self.kind == "mla" else self.head_dim


class AttentionBackend(ABC):
    """``forward`` returns ``(out [num_tokens, Hq, Dv], lse [num_tokens, Hq] fp32)``; natural-log
    LSE; a query with no valid entry gets out 0 and lse ``+inf``."""

    name: ClassVar[str]
    required_translations: ClassVar[tuple[str, ...]] = ()
    devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    kv_page_granular: ClassVar[bool] = False

    @abstractmethod
    def forward(self, q: torch.Tensor, metadata: AttentionMetadata, layer_idx: int, geometry: AttentionGeometry,
                params: SparseRuntimeParams | None) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[num_tokens, Hq, D]`` (rows ordered as the metadata's requests)."""

    def effective_attended_tokens(self, params: SparseRuntimeParams | None, metadata: AttentionMetadata,
                                  geometry: AttentionGeometry) -> torch.Tensor:
        """int64 ``[num_tokens, num_kv_heads]``: positions this backend reads per query; a backend
        that gathers whole KV pages rounds every touched page up."""
        page = metadata.kv_cache_manager.tokens_per_block if self.kv_page_granular else 1
        return attended_counts(params, metadata.token_kv_lens, geometry.num_kv_heads, page)
