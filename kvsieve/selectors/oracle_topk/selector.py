"""Oracle top-k: the exact top-k of the true attention probabilities per KV-head group (summed
over the group's query heads), at token or block granularity; the upper bound of the evaluation.
It reads every key, so it saves nothing: it measures what a perfect selector could keep.

Adaptive budget (``top_p``; Twilight, arXiv 2502.02770, which prunes a top-k candidate set the
same way): per query and KV head keep the smallest set of units (tokens or blocks), taken in
descending mass, whose mass reaches ``top_p`` of the group's total, never more than ``budget``
tokens. The budget then differs per (query, head) and the achieved sparsity is an output
(``LayerStats.attended`` counts what each query kept). On a sliding-window layer the true
attention is the window's, so the probabilities are a softmax over the window only
(:meth:`~kvsieve.sparse.SelectorInputs.window_starts`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels.decode_layer.plan import DecodeProgram
from ...metadata import KVCacheManager
from ...sparse import BudgetKnob, Capabilities, SelectorInputs, SparseRuntimeParams, SparseSelector, register_selector
from ...sparse.knobs import KnobError, check_knobs, knob
from ..common.paged import drop_empty_columns, top_p_cut, top_p_knob

__all__ = ["OracleTopKConfig", "OracleTopKSelector", "attention_mass"]

_ROW_CHUNK = 256


@dataclass(frozen=True)
class OracleTopKConfig:
    """``budget`` tokens per query (``budget // block_size`` blocks at block granularity); with
    ``top_p`` the budget is the most kept and the set stops once its mass reaches ``top_p``."""

    budget: int = knob(256, ge=1)
    block_size: int = knob(1, ge=1)
    top_p: float | None = top_p_knob()

    def __post_init__(self) -> None:
        check_knobs(self, "oracle_topk")
        if self.budget < self.block_size:
            raise KnobError(f"oracle_topk.budget must be >= block_size={self.block_size}, got {self.budget}")


def attention_mass(q: torch.Tensor, k: torch.Tensor, kv_lens: torch.Tensor, sm_scale: float,
                   starts: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``[n, Hkv, L]``: causal softmax probabilities summed over each group's query heads.

    q ``[n, Hq, D]``, k ``[L, Hkv, D]``, ``kv_lens [n]`` bounds each row (positions beyond get 0);
    ``starts [n]`` (a sliding window's first positions; default 0): positions before get 0.
    """
    n, hq, d = q.shape
    hkv = k.shape[1]
    s = torch.einsum("nhgd,lhd->nhgl", q.float().view(n, hkv, hq // hkv, d), k.float()) * sm_scale
    pos = torch.arange(k.shape[0], device=q.device)
    valid = pos < kv_lens.to(q.device).unsqueeze(1)
    if starts is not None:
        valid &= pos >= starts.to(q.device).unsqueeze(1)
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0).sum(dim=2)


@register_selector
class OracleTopKSelector(SparseSelector):
    name = "oracle_topk"
    config_class = OracleTopKConfig
    capabilities = Capabilities(attention_kinds=frozenset({"gqa", "mla"}), sliding_window=True, per_kv_head=True)
    budget = BudgetKnob("budget", unit="tokens", unit_size_field="block_size")

    def predict_attn(self, inputs: SelectorInputs) -> SparseRuntimeParams:
        bs = self.config.block_size
        lens = inputs.metadata.token_kv_lens
        r0 = inputs.rows.start
        most = -(-int(inputs.token_kv_lens_host().max(initial=1)) // bs)  # a budget past the context = all of it
        k_sel = min(self.config.budget // bs, max(most, 1))
        out = torch.full((inputs.num_rows, inputs.num_kv_heads, k_sel), -1, dtype=torch.int32, device=inputs.q.device)
        for i in inputs.requests:
            t0, t1 = inputs.query_range(i)
            keys = inputs.request_keys(i)
            if inputs.attention_kind == "mla":
                keys = keys.unsqueeze(1)
            for c0 in range(t0, t1, _ROW_CHUNK):
                c1 = min(c0 + _ROW_CHUNK, t1)
                mass = attention_mass(inputs.q[c0:c1], keys, lens[c0:c1], inputs.sm_scale,
                                      inputs.window_starts(lens[c0:c1]))
                valid = torch.arange(mass.shape[-1], device=mass.device) < lens[c0:c1, None, None].to(mass.device)
                valid = inputs.mask_outside_window(valid, lens[c0:c1], fill=False)
                if bs > 1:
                    nb = -(-mass.shape[-1] // bs)
                    pad = nb * bs - mass.shape[-1]
                    mass = torch.nn.functional.pad(mass, (0, pad)).view(*mass.shape[:2], nb, bs).sum(-1)
                    valid = torch.nn.functional.pad(valid, (0, pad)).view(*valid.shape[:2], nb, bs).any(-1)
                score = mass.masked_fill(~valid, -1.0)
                kk = min(k_sel, score.shape[-1])
                val, idx = score.topk(kk, dim=-1)
                idx = torch.where(val >= 0, idx, -1)
                if self.config.top_p is not None:
                    idx = top_p_cut(idx, val, mass.masked_fill(~valid, 0.0).sum(-1), self.config.top_p)
                out[c0 - r0:c1 - r0, :, :kk] = idx.to(torch.int32)
        if self.config.top_p is not None:  # drop the columns no query kept
            out = drop_empty_columns(out)
        return SparseRuntimeParams.from_topk(out, block_size=bs)

    def decode_program(self, cache: KVCacheManager, layer_idx: int, head_dim: int) -> DecodeProgram | None:
        c = self.config
        if c.top_p is not None:
            return None
        return DecodeProgram("tokens_exact", units=c.budget // c.block_size, unit=c.block_size)
