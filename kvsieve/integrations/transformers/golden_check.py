"""Spot checks of a session's fast backend against the Vanilla golden during a real run.

:class:`GoldenCheck` is a :data:`~kvsieve.integrations.transformers.LayerObserver`: on ``num_steps``
randomly chosen generation steps it recomputes every layer's attention with the Vanilla golden
(same selection, same window / softcap / sinks, K/V from the same paged cache) and compares it
with what the session's backend returned; a difference above ``tolerance`` raises, naming the
step and layer. Each generation step is checked with probability ``rate`` until ``num_steps``
steps were checked.
"""
from __future__ import annotations

import random

import torch

from ...metadata import AttentionMetadata
from ...sparse import LayerOutput, SparseAttention
from ...sparse.backends import VanillaBackend
from .attention_features import LayerFeatures
from .feature_backend import FeatureBackend

__all__ = ["GoldenCheck", "GOLDEN_TRANSLATIONS"]

#: metadata translations the golden reads (the session's engine must prepare them)
GOLDEN_TRANSLATIONS = VanillaBackend.required_translations


class GoldenCheck:
    """Compare ``num_steps`` random generation steps with the golden; ``max_diff`` is the largest
    ``|out - golden|`` seen, ``steps_checked`` how many steps were compared."""

    def __init__(self, features: list[LayerFeatures], num_steps: int, *, tolerance: float = 1e-3,
                 rate: float = 0.5, seed: int = 0) -> None:
        if num_steps < 1 or not 0 < rate <= 1 or tolerance <= 0:
            raise ValueError(f"need num_steps >= 1, 0 < rate <= 1, tolerance > 0; got {num_steps}, {rate}, {tolerance}")
        self.golden = FeatureBackend(VanillaBackend(), features, dense_fast_path=False)
        self.num_steps = num_steps
        self.tolerance = tolerance
        self.rate = rate
        self.rng = random.Random(seed)
        self.steps_checked = 0
        self.max_diff = 0.0
        self._checking = False

    def __call__(self, layer_idx: int, q: torch.Tensor, result: LayerOutput, metadata: AttentionMetadata,
                 layer: SparseAttention) -> None:
        if layer_idx == 0:  # a new step: check it?
            self._checking = (metadata.num_contexts == 0 and self.steps_checked < self.num_steps
                              and self.rng.random() < self.rate)
            self.steps_checked += self._checking
        if not self._checking:
            return
        out = result.out
        want = self.golden.forward(q, metadata, layer_idx, layer.geometry, result.params).out
        diff = (out.float() - want[..., : out.shape[-1]].float()).abs().max().item()
        self.max_diff = max(self.max_diff, diff)
        if diff > self.tolerance:
            raise AssertionError(f"golden check: step {self.steps_checked}, layer {layer_idx}: backend "
                                 f"{layer.backend.name!r} differs from vanilla by {diff:.3g} > {self.tolerance}")
