"""StreamingLLM (arXiv 2309.17453): attention sinks plus a recent window; the lower bound of
the evaluation. Needs no keys, so it serves GQA and MLA, context and generation. On a
sliding-window layer the sinks are the window's first ``num_sink`` positions and the recent
positions its last ones (:meth:`~kvsieve.sparse.SelectorInputs.window_starts`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels.decode_layer.plan import DecodeProgram
from ...metadata import KVCacheManager
from ...sparse import BudgetKnob, Capabilities, SelectorInputs, SparseRuntimeParams, SparseSelector, register_selector
from ...sparse.knobs import KnobError, check_knobs, knob

__all__ = ["StreamingConfig", "StreamingSelector", "streaming_topk"]


@dataclass(frozen=True)
class StreamingConfig:
    """``budget`` tokens per query: the first ``num_sink`` plus the most recent ``budget - num_sink``."""

    budget: int = knob(256, ge=1)
    num_sink: int = knob(4, ge=0)

    def __post_init__(self) -> None:
        check_knobs(self, "streaming")
        if self.num_sink >= self.budget:
            raise KnobError(f"streaming.num_sink must be < budget={self.budget}, got {self.num_sink}")


def streaming_topk(kv_lens: torch.Tensor, budget: int, num_sink: int) -> torch.Tensor:
    """int32 ``[num_tokens, width]``: per query its sinks then its window, ascending, ``-1`` padding last.

    ``kv_lens [num_tokens]``: positions each query may attend. A query with ``kv_len <= budget``
    gets every position; ``width`` is ``budget``, capped past the longest context (a budget above
    the context means everything, without allocating the budget). Already in the carrier's order, so
    :meth:`~kvsieve.sparse.SparseRuntimeParams.from_topk` packs a prompt's selection without sorting it.
    """
    lens = kv_lens.to(torch.int64).unsqueeze(1)
    longest = int(lens.max()) if lens.numel() else 0
    num_sink = min(num_sink, longest)
    budget = min(budget, longest + num_sink + 1)
    cols = torch.arange(budget, device=kv_lens.device)
    every = torch.where(cols < lens, cols, -1)  # a query seeing at most `budget` positions: all of them
    # else its sinks, then its last budget - num_sink positions (which start past the sinks)
    sinks_window = torch.where(cols < num_sink, cols, lens - budget + cols)
    return torch.where(lens > budget, sinks_window, every).to(torch.int32)


@register_selector
class StreamingSelector(SparseSelector):
    name = "streaming"
    config_class = StreamingConfig
    capabilities = Capabilities(attention_kinds=frozenset({"gqa", "mla"}), sliding_window=True, per_kv_head=True)
    budget = BudgetKnob("budget", unit="tokens")

    def predict_attn(self, inputs: SelectorInputs) -> SparseRuntimeParams:
        lens = inputs.row_kv_lens
        start = inputs.window_starts(lens).to(lens.device)  # positions counted from the window's start
        sel = streaming_topk(lens - start, self.config.budget, self.config.num_sink)
        if bool(start.any()):  # a sliding-window layer: positions counted from the window's start
            sel = torch.where(sel >= 0, sel + start.unsqueeze(1), -1).to(torch.int32)
        sel = sel.unsqueeze(1).expand(-1, inputs.num_kv_heads, -1)
        return SparseRuntimeParams.from_topk(sel)

    def decode_program(self, cache: KVCacheManager, layer_idx: int, head_dim: int) -> DecodeProgram:
        return DecodeProgram("streaming", units=self.config.budget, num_sink=self.config.num_sink)
