"""The geometry of a paged KV cache (:class:`KVCacheSpec`), apart from the manager that holds
one, so the manager's parts (:mod:`.kv_pools`, :mod:`.kv_sharing`) can name it without a cycle."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["KVCacheSpec"]


@dataclass(frozen=True)
class KVCacheSpec:
    """Geometry of the paged cache. ``kind="mla"`` ignores ``num_kv_heads``/``head_dim``."""

    num_layers: int
    num_blocks: int
    tokens_per_block: int
    kind: Literal["gqa", "mla"] = "gqa"
    num_kv_heads: int = 1
    head_dim: int = 64
    kv_lora_rank: int = 0
    rope_dim: int = 0
    layout: Literal["HND", "NHD"] = "HND"
    dtype: torch.dtype = torch.float32
    device: str | torch.device = "cpu"
    max_requests: int = 64
    max_blocks_per_seq: int = 256
    #: the model layers this cache holds (a cache group, e.g. a hybrid model's sliding-window layers);
    #: ``None`` = all ``num_layers``. Layer ids stay the model's; a layer outside has an empty pool.
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        positive = ("num_layers", "num_blocks", "tokens_per_block", "max_requests", "max_blocks_per_seq")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"KVCacheSpec.{name} must be an int >= 1, got {type(value).__name__} {value!r}")
            if value < 1:
                raise ValueError(f"KVCacheSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks < 2:
            raise ValueError("KVCacheSpec.num_blocks must be >= 2 (block 0 is the reserved sentinel)")
        if self.kind not in ("gqa", "mla"):
            raise ValueError(f"KVCacheSpec.kind must be 'gqa' or 'mla', got {self.kind!r}")
        if self.layout not in ("HND", "NHD"):
            raise ValueError(f"KVCacheSpec.layout must be 'HND' or 'NHD', got {self.layout!r}")
        if self.kind == "gqa" and (self.num_kv_heads < 1 or self.head_dim < 1):
            raise ValueError("KVCacheSpec: GQA needs num_kv_heads >= 1 and head_dim >= 1")
        if self.kind == "mla" and self.kv_lora_rank < 1:
            raise ValueError("KVCacheSpec: MLA needs kv_lora_rank >= 1")
        if self.layers is not None and (len(set(self.layers)) != len(self.layers) or not self.layers
                                        or not all(isinstance(i, int) and 0 <= i < self.num_layers for i in self.layers)):
            raise ValueError(f"KVCacheSpec.layers must be distinct layer ids in [0, {self.num_layers}), got {self.layers}")
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"KVCacheSpec.dtype must be float32, float16 or bfloat16, got {self.dtype}")

    @property
    def held_layers(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers)) if self.layers is None else tuple(sorted(self.layers))

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def pool_shape(self) -> tuple[int, ...]:
        n, p = self.num_blocks, self.tokens_per_block
        if self.kind == "mla":
            return (n, p, self.latent_dim)
        if self.layout == "HND":
            return (n, 2, self.num_kv_heads, p, self.head_dim)
        return (n, 2, p, self.num_kv_heads, self.head_dim)
