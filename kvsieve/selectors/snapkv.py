"""SnapKV (arXiv 2404.14469): prompt eviction from the attention of an observation window.

Stage 1 of RocketKV alone (:mod:`._prefill_scoring`): the last ``window_size`` prompt queries
vote (softmax over the prefix, summed over window queries and the query heads of each KV group),
the votes are max-pooled with ``kernel_size`` and the top ``prompt_budget - window_size`` prefix
tokens plus the window are kept per KV head. Decode then attends the compacted cache densely.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sparse import Capabilities, SelectorInputs, SparseSelector, register_selector
from ..sparse.knobs import check_knobs, knob
from ._prefill_scoring import PromptBudget, check_prompt_budget, pack_kept, snap_keep, snap_keep_golden

__all__ = ["SnapKVConfig", "SnapKVSelector"]


@dataclass(frozen=True)
class SnapKVConfig:
    """``window_size`` 32 and max-pool ``kernel_size`` 7 are SnapKV's published LongBench setting
    (``ablation_c1024_w32_k7_maxpool``); ``prompt_budget`` (1024) counts the window too."""

    window_size: int = knob(32, ge=1)
    kernel_size: int = knob(7, ge=1)
    prompt_budget: int = knob(1024, ge=1)

    def __post_init__(self) -> None:
        check_knobs(self, "snapkv")
        check_prompt_budget("snapkv", self.window_size, self.kernel_size, self.prompt_budget)


@register_selector
class SnapKVSelector(SparseSelector):
    name = "snapkv"
    config_class = SnapKVConfig
    capabilities = Capabilities(phases=frozenset({"context"}), evicts=True)

    def _budget(self) -> PromptBudget:
        c = self.config
        return PromptBudget(c.window_size, c.kernel_size, c.prompt_budget)

    def predict_kv(self, inputs: SelectorInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        return pack_kept(snap_keep(inputs, self._budget()))

    def predict_kv_reference(self, inputs: SelectorInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The per-request reference of :meth:`predict_kv`."""
        return pack_kept(snap_keep_golden(inputs, self._budget()))
