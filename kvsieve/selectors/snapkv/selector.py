"""SnapKV (arXiv 2404.14469): prompt eviction from the attention of an observation window.

Stage 1 of RocketKV alone (:mod:`..common.prefill_scoring`): the last ``window_size`` prompt queries
vote (their softmax probabilities of the prefix keys, summed over the window queries and the
query heads of each KV group), the votes are pooled with ``kernel_size`` and the top
``prompt_budget - window_size`` prefix tokens plus the window are kept per KV head. Decode then
attends the compacted cache densely.

The definition has variants that move the kept set (``docs/selectors.md`` gives the Jaccard
between them): the window (32 vs 64), the kernel (7 vs 5), ``pooling`` (max vs avg),
``softmax_over`` (the prefix only, or every key the window query sees) and ``group_sum``
(the query group summed before or after pooling). NVIDIA kvpress's ``SnapKVPress`` is
``window_size=64, kernel_size=5, pooling="avg", softmax_over="all", group_sum="after_pool"``
(``tests/selectors/test_snapkv_kvpress.py`` reproduces its kept set).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...sparse import BudgetKnob, Capabilities, SelectorInputs, SparseSelector, register_selector
from ...sparse.knobs import check_knobs, knob
from ..common.prefill_scoring import (GROUP_SUMS, POOLINGS, SOFTMAX_OVER, PromptBudget, check_prompt_budget, pack_kept,
                               snap_keep, snap_keep_naive)

__all__ = ["SnapKVConfig", "SnapKVSelector"]


@dataclass(frozen=True)
class SnapKVConfig:
    """Defaults and the reference each follows:

    * ``window_size`` 32, ``kernel_size`` 7, ``pooling`` ``"max"``: SnapKV's published LongBench
      setting (``ablation_c1024_w32_k7_maxpool``); ``prompt_budget`` (1024) counts the window too.
    * ``softmax_over`` ``"all"``: SnapKV's code (``snapkv/monkeypatch/snapkv_utils.py``,
      ``SnapKVCluster.update_kv``: softmax of the window rows over every key, causal inside the
      window, then the prefix columns) and kvpress (``SnapKVPress.compute_window_attention``).
      ``"prefix"`` (softmax over the prefix keys only) is kvsieve's earlier definition, still the
      one of ``rocketkv`` stage 1; no reference we read uses it.
    * ``group_sum`` ``"after_pool"``: kvpress (``SnapKVPress.score``: pool each query head, then
      average the group, after SnapKV issue #22). SnapKV's code pools per query head too.
    """

    window_size: int = knob(32, ge=1)
    kernel_size: int = knob(7, ge=1)
    prompt_budget: int = knob(1024, ge=1)
    pooling: str = knob("max", choices=POOLINGS)
    softmax_over: str = knob("all", choices=SOFTMAX_OVER, doc="keys the window's softmax runs over")
    group_sum: str = knob("after_pool", choices=GROUP_SUMS, doc="where the query group is summed")

    def __post_init__(self) -> None:
        check_knobs(self, "snapkv")
        check_prompt_budget("snapkv", self.window_size, self.kernel_size, self.prompt_budget)


@register_selector
class SnapKVSelector(SparseSelector):
    name = "snapkv"
    config_class = SnapKVConfig
    capabilities = Capabilities(phases=frozenset({"context"}), evicts=True, per_kv_head=True)
    budget = BudgetKnob("prompt_budget", unit="tokens")

    def _budget(self) -> PromptBudget:
        c = self.config
        return PromptBudget(c.window_size, c.kernel_size, c.prompt_budget, c.pooling, c.softmax_over, c.group_sum)

    def predict_kv(self, inputs: SelectorInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        return pack_kept(snap_keep(inputs, self._budget()))

    def predict_kv_naive(self, inputs: SelectorInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The per-request reference of :meth:`predict_kv`."""
        return pack_kept(snap_keep_naive(inputs, self._budget()))
