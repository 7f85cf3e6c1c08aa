"""RocketKV (arXiv 2502.14051; TensorRT-LLM ``rocket``): two-stage KV selection for GQA.

* Stage 1, prefill (``predict_kv``): SnapKV-style permanent eviction of prompt tokens down to
  ``prompt_budget`` per KV head (:mod:`..common.prefill_scoring`, max pooling, softmax over the prefix,
  the query group summed before pooling: kvsieve's definition, not checked against RocketKV's
  code); the layer compacts the cache after the (dense) prompt attention and the engine commits
  the shorter length.
* Stage 2, decode (``predict_attn``): page-level top-k over K min/max page summaries with the
  sign trick and an optional top-``topr`` query-channel filter (:mod:`..common.page_summary`); indices
  at block granularity ``page_size``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...sparse import BudgetKnob, Capabilities, SelectorInputs, register_selector
from ...sparse.knobs import check_knobs, knob
from ..common.page_selector import PageKnobs, PageSelectorBase
from ..common.page_summary import SUMMARY_DTYPES
from ..common.paged import check_power_of_two
from ..common.prefill_scoring import PromptBudget, check_prompt_budget, pack_kept, snap_keep, snap_keep_naive

__all__ = ["RocketKVConfig", "RocketKVSelector"]


@dataclass(frozen=True)
class RocketKVConfig:
    """Defaults are TensorRT-LLM's ``RocketSparseAttentionConfig`` (blog 17 LongBench setting).

    ``window_size`` (32) observation window, always kept; ``kernel_size`` (63) max-pool width, odd;
    ``prompt_budget`` (2048) prompt tokens kept per KV head; ``page_size`` (4) summary page, a
    power of two dividing the cache's ``tokens_per_block``; ``topk`` (64) pages per decode query;
    ``topr`` query channels scored (``None`` = head_dim, filter off); ``summary_dtype``
    (``"float8_e5m2"``, or ``"bfloat16"``/``"float32"``).
    """

    window_size: int = knob(32, ge=1)
    kernel_size: int = knob(63, ge=1)
    prompt_budget: int = knob(2048, ge=1)
    page_size: int = knob(4, ge=1)
    topk: int = knob(64, ge=1, doc="pages per query")
    topr: int | None = knob(None, ge=1)
    summary_dtype: str = knob("float8_e5m2", choices=SUMMARY_DTYPES)

    def __post_init__(self) -> None:
        check_knobs(self, "rocketkv")
        check_prompt_budget("rocketkv", self.window_size, self.kernel_size, self.prompt_budget)
        check_power_of_two("rocketkv", "page_size", self.page_size)


@register_selector
class RocketKVSelector(PageSelectorBase):
    name = "rocketkv"
    config_class = RocketKVConfig
    capabilities = Capabilities(evicts=True, per_kv_head=True)
    budget = BudgetKnob("topk", unit="pages", unit_size_field="page_size")  # stage 2; prompt_budget is stage 1
    mode = "sign"

    def page_knobs(self, head_dim: int) -> PageKnobs:
        c = self.config
        topr = head_dim if c.topr is None else min(c.topr, head_dim)
        return PageKnobs(c.page_size, c.topk, topr, c.summary_dtype, None)

    def _budget(self) -> PromptBudget:
        c = self.config
        return PromptBudget(c.window_size, c.kernel_size, c.prompt_budget, "max", "prefix", "before_pool")

    def predict_kv(self, inputs: SelectorInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        return pack_kept(snap_keep(inputs, self._budget()))

    def predict_kv_naive(self, inputs: SelectorInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The per-request reference of :meth:`predict_kv`."""
        return pack_kept(snap_keep_naive(inputs, self._budget()))
