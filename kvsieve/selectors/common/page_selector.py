"""The page-selecting selectors' shared base (``rocketkv`` stage 2, ``quest``): keep page summaries
in sync with the cache and select pages for generation rows (:mod:`.page_summary`)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...metadata import KVCacheManager
from ...sparse import SelectorInputs, SparseRuntimeParams, SparseSelector
from .page_summary import SUMMARY_DTYPES, PageSummaries, select_pages, select_pages_naive

__all__ = ["PageKnobs", "PageSelectorBase"]


@dataclass(frozen=True)
class PageKnobs:
    """A page selector's settings for one head dim: ``page_size`` tokens per page, ``topk`` pages
    per query, ``topr`` query channels scored, ``summary_dtype`` of the min/max summaries,
    ``top_p`` the adaptive budget (``None`` = always ``topk`` pages)."""

    page_size: int
    topk: int
    topr: int
    summary_dtype: str
    top_p: float | None


class PageSelectorBase(SparseSelector):
    """Page summaries refreshed on every append and compaction; pages chosen for generation rows.

    Subclasses give ``mode`` (``"sign"``/``"bound"``) and :meth:`page_knobs`.
    """

    mode: str = "sign"

    def __init__(self, config: object = None, **overrides: object) -> None:
        super().__init__(config, **overrides)
        self._summaries: PageSummaries | None = None

    def page_knobs(self, head_dim: int) -> PageKnobs:
        raise NotImplementedError

    def summaries(self, inputs: SelectorInputs) -> PageSummaries:
        return self.summaries_of(inputs.cache, inputs.q.shape[-1])

    def summaries_of(self, cache: KVCacheManager, head_dim: int) -> PageSummaries:
        """The page-summary pools of ``cache`` (created on first use; the pool of a name is shared)."""
        knobs = self.page_knobs(head_dim)
        if self._summaries is None or self._summaries.cache is not cache:
            self._summaries = PageSummaries(cache, knobs.page_size, SUMMARY_DTYPES[knobs.summary_dtype])
        return self._summaries

    def on_append(self, inputs: SelectorInputs) -> None:
        md = inputs.metadata
        self.summaries(inputs).refresh(inputs.layer_idx, md.slots, md.cached_lens_host, md.kv_lens_host)

    def on_attach(self, inputs: SelectorInputs, requests: np.ndarray) -> None:
        """Summarize, from the cache, the pages of the positions ``requests`` held before this
        selector was installed (``[0, kv_len - q_len)``)."""
        md = inputs.metadata
        starts = md.cached_lens_host[requests]
        self.summaries(inputs).refresh(inputs.layer_idx, md.slots[requests], np.zeros_like(starts), starts)

    def on_compacted(self, inputs: SelectorInputs, kept: list[torch.Tensor]) -> None:
        n_keep = np.array([k.shape[1] for k in kept], dtype=np.int64)
        slots = inputs.metadata.slots[: len(kept)]
        self.summaries(inputs).refresh(inputs.layer_idx, slots, np.zeros_like(n_keep), n_keep)

    def predict_attn(self, inputs: SelectorInputs) -> SparseRuntimeParams | None:
        knobs = self.page_knobs(inputs.q.shape[-1])
        return select_pages(inputs, self.summaries(inputs), mode=self.mode, topk=knobs.topk, topr=knobs.topr,
                            top_p=knobs.top_p)

    def predict_attn_naive(self, inputs: SelectorInputs) -> SparseRuntimeParams | None:
        """The plain-PyTorch per-request reference of :meth:`predict_attn`."""
        knobs = self.page_knobs(inputs.q.shape[-1])
        return select_pages_naive(inputs, page_size=knobs.page_size, dtype=SUMMARY_DTYPES[knobs.summary_dtype],
                                   mode=self.mode, topk=knobs.topk, topr=knobs.topr, top_p=knobs.top_p)
