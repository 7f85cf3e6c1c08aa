"""Quest (arXiv 2406.10774): query-aware page selection at decode time.

Per page of ``page_size`` tokens the K min/max summaries (shared with RocketKV stage 2,
:mod:`..common.page_summary`) give the upper bound ``sum_d max(q_d * min_d, q_d * max_d)`` of ``q . k``;
the top ``budget // page_size`` pages per (query token, KV head) are attended, the newest
page always among them. For GQA the per-head bounds are turned into a softmax over pages and
averaged over the group (with one query head per KV head this is exactly Quest's ranking).
Nothing is evicted; prefill stays dense.

Adaptive budget (``top_p``, beyond Quest; Twilight, arXiv 2502.02770): the estimated mass of a
page is that same group-averaged softmax over the valid pages (it sums to 1 and ranks the pages
as Quest does). Per (query token, KV head) the newest page comes first, then pages in
descending mass, and the list stops once the mass before the next page reaches ``top_p``;
never more than ``budget // page_size`` pages.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...kernels.decode_layer.plan import DecodeProgram
from ...metadata import KVCacheManager
from ...sparse import BudgetKnob, Capabilities, register_selector
from ...sparse.knobs import KnobError, check_knobs, knob
from ..common.page_selector import PageKnobs, PageSelectorBase
from ..common.page_summary import SUMMARY_DTYPES
from ..common.paged import check_power_of_two, top_p_knob

__all__ = ["QuestConfig", "QuestSelector"]


@dataclass(frozen=True)
class QuestConfig:
    """``page_size`` (16) and ``budget`` (256) are the defaults of Quest's
    ``scripts/bench_textgen.py``; ``summary_dtype`` ``"bfloat16"`` (Quest keeps its metadata in
    the KV dtype), or ``"float8_e5m2"``/``"float32"``; ``top_p`` (``None``) turns ``budget`` into
    a cap (module docstring)."""

    budget: int = knob(256, ge=1)
    page_size: int = knob(16, ge=1)
    summary_dtype: str = knob("bfloat16", choices=SUMMARY_DTYPES)
    top_p: float | None = top_p_knob()

    def __post_init__(self) -> None:
        check_knobs(self, "quest")
        if self.budget < self.page_size:
            raise KnobError(f"quest.budget must be >= page_size={self.page_size} (at least one page), "
                             f"got {self.budget}")
        check_power_of_two("quest", "page_size", self.page_size)

    @property
    def topk(self) -> int:
        return self.budget // self.page_size


@register_selector
class QuestSelector(PageSelectorBase):
    name = "quest"
    config_class = QuestConfig
    capabilities = Capabilities(phases=frozenset({"generation"}), sliding_window=True, per_kv_head=True)
    budget = BudgetKnob("budget", unit="tokens", unit_size_field="page_size")
    mode = "bound"

    def page_knobs(self, head_dim: int) -> PageKnobs:
        c = self.config
        return PageKnobs(c.page_size, c.topk, head_dim, c.summary_dtype, c.top_p)

    def decode_program(self, cache: KVCacheManager, layer_idx: int, head_dim: int) -> DecodeProgram | None:
        """Pages ranked by the bound (the same ranking code as ``predict_attn``'s decode path); none
        with ``top_p`` or fp8 summaries."""
        c = self.config
        if c.top_p is not None or c.summary_dtype == "float8_e5m2":
            return None
        pool = self.summaries_of(cache, head_dim).pools[layer_idx]
        return DecodeProgram("pages", units=c.topk, unit=c.page_size, mode=self.mode, pool=pool, page_size=c.page_size)
