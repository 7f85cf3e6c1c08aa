"""``recent_blocks``: attend the first block and the ``num_blocks - 1`` most recent blocks.

A complete out-of-tree selector: a config dataclass, declared capabilities and budget knob, and
one hook. kvsieve finds it through the ``kvsieve.selectors`` entry point declared in this
package's pyproject.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvsieve import BudgetKnob, Capabilities, SelectorInputs, SparseRuntimeParams, SparseSelector


@dataclass(frozen=True)
class RecentBlocksConfig:
    block_size: int = 16
    num_blocks: int = 4

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_blocks < 2:
            raise ValueError("recent_blocks: block_size must be >= 1 and num_blocks >= 2")


class RecentBlocksSelector(SparseSelector):
    name = "recent_blocks"
    config_class = RecentBlocksConfig
    capabilities = Capabilities(phases=frozenset({"generation"}), per_kv_head=True)
    budget = BudgetKnob("num_blocks", unit="blocks", unit_size_field="block_size")

    def predict_attn(self, inputs: SelectorInputs) -> SparseRuntimeParams:
        c = self.config
        lens = inputs.row_kv_lens.to(torch.int64)  # the rows asked about (generation rows)
        last = (lens - 1) // c.block_size  # block of the newest position
        recent = last.unsqueeze(1) - torch.arange(c.num_blocks - 2, -1, -1, device=lens.device)
        recent = torch.where(recent >= 1, recent, -1)
        first = torch.zeros_like(last).unsqueeze(1)
        sel = torch.cat([first, recent], dim=1).unsqueeze(1).expand(-1, inputs.num_kv_heads, -1)
        return SparseRuntimeParams.from_topk(sel.to(torch.int32), block_size=c.block_size)
