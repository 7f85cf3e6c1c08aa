"""The options of ``kvsieve distill-indexer`` (:class:`DistillConfig`), apart from the training
code so that the eval config can name their defaults without importing transformers."""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DistillConfig"]


@dataclass(frozen=True)
class DistillConfig:
    """Indexer geometry (``n_heads x head_dim``, RoPE on ``rope_dim`` channels) and training:
    ``num_seqs`` training windows and ``heldout_seqs`` held-out windows of ``seq_len`` tokens,
    ``rows`` query rows sampled per window, ``epochs`` passes with Adam (``lr``, cosine decay),
    ``seed``; ``holdout_every``: every so many essays are held out."""

    n_heads: int = 8
    head_dim: int = 32
    rope_dim: int = 16
    seq_len: int = 2048
    num_seqs: int = 16
    heldout_seqs: int = 2
    rows: int = 256
    epochs: int = 8
    lr: float = 3e-3
    seed: int = 0
    holdout_every: int = 2

    def __post_init__(self) -> None:
        for name in ("n_heads", "head_dim", "seq_len", "num_seqs", "heldout_seqs", "rows", "epochs", "holdout_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"DistillConfig.{name}: expected >= 1, got {getattr(self, name)}")
        if not 0 <= self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ValueError(f"DistillConfig.rope_dim: expected an even number in [0, head_dim={self.head_dim}], "
                             f"got {self.rope_dim}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"DistillConfig.lr: expected a finite number > 0, got {self.lr}")
        if self.rows > self.seq_len:
            raise ValueError(f"DistillConfig.rows: {self.rows} rows cannot be sampled from {self.seq_len} positions")
