"""The options of the indexer's distillation (:class:`DistillConfig`: ``kvsieve distill-indexer``
and the ``distill_indexer`` calibration step), apart from the training code so that the step's
defaults are known without importing it."""
from __future__ import annotations

from dataclasses import dataclass

from ...sparse.knobs import KnobError, check_knobs, knob

__all__ = ["DistillConfig"]


@dataclass(frozen=True)
class DistillConfig:
    """Indexer geometry (``n_heads x head_dim``, RoPE on ``rope_dim`` channels) and training:
    ``num_seqs`` training windows and ``heldout_seqs`` held-out windows of ``seq_len`` tokens (an
    int, or a tuple of distinct lengths: that many windows, and ``retrieval_seqs``, at each;
    :attr:`lengths`),
    ``rows`` query rows sampled per window, ``epochs`` passes with Adam (``lr``, cosine decay),
    ``seed``; ``holdout_every``: every so many essays are held out; ``retrieval_seqs`` more
    training windows of training essays with ``retrieval_facts`` synthetic facts inserted and a
    question and its answer per fact at the end, whose sampled rows include every row of that
    tail (:mod:`.distill_retrieval`)."""

    n_heads: int = knob(8, ge=1, doc="indexer heads")
    head_dim: int = knob(32, ge=1, doc="indexer head dim")
    rope_dim: int = knob(16, ge=0, doc="even, <= head_dim")
    seq_len: int | tuple[int, ...] = knob(2048, doc="tokens per window, or several lengths")
    num_seqs: int = knob(16, ge=1, doc="training windows")
    heldout_seqs: int = knob(2, ge=1, doc="held-out windows")
    rows: int = knob(256, ge=1, doc="query rows sampled per window, <= seq_len")
    epochs: int = knob(8, ge=1)
    lr: float = knob(3e-3, gt=0)
    seed: int = 0
    holdout_every: int = knob(2, ge=1, doc="every so many essays held out")
    retrieval_seqs: int = knob(0, ge=0, doc="extra training windows of essays with facts asked at the end")
    retrieval_facts: int = knob(8, ge=1, doc="facts (each asked once) per retrieval window")

    def __post_init__(self) -> None:
        if isinstance(self.seq_len, list):  # as YAML (calibrate_params) and JSON give several lengths
            object.__setattr__(self, "seq_len", tuple(self.seq_len))
        check_knobs(self, "DistillConfig")
        lengths = self.lengths
        if not lengths or min(lengths) < 1 or len(set(lengths)) < len(lengths):
            raise KnobError(f"DistillConfig.seq_len must be an int >= 1 or a non-empty tuple of distinct ints >= 1, "
                            f"got {self.seq_len!r}")
        if self.rope_dim > self.head_dim or self.rope_dim % 2:
            raise KnobError(f"DistillConfig.rope_dim must be an even number <= head_dim={self.head_dim}, "
                            f"got {self.rope_dim}")
        if self.rows > min(lengths):
            raise KnobError(f"DistillConfig.rows must be <= seq_len={min(lengths)} (rows are sampled from "
                            f"its positions), got {self.rows}")

    @property
    def lengths(self) -> tuple[int, ...]:
        """The window lengths, ``seq_len`` as a tuple (in the order given)."""
        return self.seq_len if isinstance(self.seq_len, tuple) else (self.seq_len,)
