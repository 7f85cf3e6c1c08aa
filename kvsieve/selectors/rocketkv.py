"""RocketKV (arXiv 2502.14051; TensorRT-LLM ``rocket``): two-stage KV selection for GQA.

* Stage 1, prefill (``predict_kv``): SnapKV-style permanent eviction of prompt tokens down to
  ``prompt_budget`` per KV head (:mod:`._prefill_scoring`); the layer compacts the cache after the
  (dense) prompt attention and the engine commits the shorter length.
* Stage 2, decode (``predict_attn``): page-level top-k over K min/max page summaries with the
  sign trick and an optional top-``topr`` query-channel filter (:mod:`._page_summary`); indices
  at block granularity ``page_size``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..sparse import Capabilities, SelectorInputs, SparseRuntimeParams, SparseSelector, register_selector
from ..sparse.knobs import check_knobs, knob
from ..sparse.params import SparseMetadataParams
from ._paged import check_power_of_two
from ._page_summary import SUMMARY_DTYPES, PageSummaries, select_pages, select_pages_golden
from ._prefill_scoring import PromptBudget, check_prompt_budget, pack_kept, snap_keep, snap_keep_golden

__all__ = ["RocketKVConfig", "RocketKVSelector", "PageSelectorBase"]


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
        check_page_knobs("rocketkv", self.page_size, self.topk, self.summary_dtype)


def check_page_knobs(owner: str, page_size: int, topk: int, summary_dtype: str) -> None:
    """Validation shared by the stage-2 configs."""
    check_power_of_two(owner, "page_size", page_size)
    if topk < 1:
        raise ValueError(f"{owner}: topk (pages per query) must be >= 1, got {topk}")
    if summary_dtype not in SUMMARY_DTYPES:
        raise ValueError(f"{owner}: summary_dtype must be one of {sorted(SUMMARY_DTYPES)}, got {summary_dtype!r}")


class PageSelectorBase(SparseSelector):
    """Stage-2 machinery: keep page summaries in sync with the cache and select pages on decode.

    Subclasses give ``mode`` (``"sign"``/``"bound"``) and the page knobs through ``_page_knobs``.
    """

    mode: str = "sign"

    def __init__(self, config: object = None, **overrides: object) -> None:
        super().__init__(config, **overrides)
        self._summaries: PageSummaries | None = None

    def _page_knobs(self, head_dim: int) -> tuple[int, int, int, str]:
        """``(page_size, topk pages, topr, summary_dtype)``."""
        raise NotImplementedError

    def summaries(self, inputs: SelectorInputs) -> PageSummaries:
        page_size, _, _, dtype = self._page_knobs(inputs.q.shape[-1])
        if self._summaries is None or self._summaries.cache is not inputs.cache:
            self._summaries = PageSummaries(inputs.cache, page_size, SUMMARY_DTYPES[dtype])
        return self._summaries

    def on_append(self, inputs: SelectorInputs) -> None:
        md = inputs.metadata
        lens = md.kv_lens_host[: md.num_seqs]
        starts = lens - np.diff(md.query_start_host[: md.num_seqs + 1])
        self.summaries(inputs).refresh(inputs.layer_idx, md.slots, starts, lens)

    def on_compacted(self, inputs: SelectorInputs, kept: list[torch.Tensor]) -> None:
        n_keep = np.array([k.shape[1] for k in kept], dtype=np.int64)
        slots = inputs.metadata.slots[: len(kept)]
        self.summaries(inputs).refresh(inputs.layer_idx, slots, np.zeros_like(n_keep), n_keep)

    def predict_attn(self, inputs: SelectorInputs) -> SparseRuntimeParams | None:
        _, topk, topr, _ = self._page_knobs(inputs.q.shape[-1])
        return select_pages(inputs, self.summaries(inputs), mode=self.mode, topk=topk, topr=topr)

    def predict_attn_golden(self, inputs: SelectorInputs) -> SparseRuntimeParams | None:
        """The plain-PyTorch per-request reference of :meth:`predict_attn` (tests compare them)."""
        page_size, topk, topr, dtype = self._page_knobs(inputs.q.shape[-1])
        return select_pages_golden(inputs, page_size=page_size, dtype=SUMMARY_DTYPES[dtype], mode=self.mode,
                                   topk=topk, topr=topr)


@register_selector
class RocketKVSelector(PageSelectorBase):
    name = "rocketkv"
    config_class = RocketKVConfig
    capabilities = Capabilities(granularity="block", evicts=True)
    mode = "sign"

    def metadata_params(self) -> SparseMetadataParams:
        # context rows of a mixed batch attend densely, so no per-token bound on the selection width
        c = self.config
        return SparseMetadataParams(indices_block_size=c.page_size, prompt_budget=c.prompt_budget)

    def _page_knobs(self, head_dim: int) -> tuple[int, int, int, str]:
        c = self.config
        topr = head_dim if c.topr is None else min(c.topr, head_dim)
        return c.page_size, c.topk, topr, c.summary_dtype

    def _budget(self) -> PromptBudget:
        c = self.config
        return PromptBudget(c.window_size, c.kernel_size, c.prompt_budget)

    def predict_kv(self, inputs: SelectorInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        return pack_kept(snap_keep(inputs, self._budget()))

    def predict_kv_golden(self, inputs: SelectorInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The per-request reference of :meth:`predict_kv`."""
        return pack_kept(snap_keep_golden(inputs, self._budget()))
