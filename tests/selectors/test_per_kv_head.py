"""``Capabilities.per_kv_head``: a selector declaring it decides each KV head from that head alone, so
a tensor-parallel worker holding a shard of the heads (vLLM splits KV heads with their query groups)
chooses for its heads exactly what one process holding all heads chooses. Checked for every built-in
(``tests/default_selectors.py``) by running it on all heads and on each one-head shard, step by step;
a selector that shares one choice across heads fails the same check (the check can fail)."""
from __future__ import annotations

import pytest
import torch
from default_selectors import DEFAULT_SELECTORS, NEEDS_MODEL_INPUTS
from harness import Harness, selection_sets

from kvsieve.selectors import IndexerInputs
from kvsieve.sparse import SelectorInputs, SparseRuntimeParams, SparseSelector, get_selector_class

HKV, G, D = 2, 2, 16
# (request ids, query tokens per request, context requests): two prompts, a decode step, a mixed step
STEPS = [([0, 1], [90, 60], 2), ([0, 1], [1, 1], 0), ([2, 0, 1], [40, 1, 1], 1)]


class SharedTopK(SparseSelector):
    """Not per KV head: one top-k of the logits summed over every query head, given to all KV heads."""

    name = "shared_topk_test"
    config_class = dict

    def predict_attn(self, inputs: SelectorInputs) -> SparseRuntimeParams:
        out = torch.full((inputs.num_rows, inputs.num_kv_heads, 8), -1, dtype=torch.int32)
        for i in inputs.requests:
            t0, t1 = inputs.query_range(i)
            keys = inputs.request_keys(i).float()  # [L, Hkv, D]
            scores = torch.einsum("thd,lkd->tl", inputs.q[t0:t1].float(), keys)
            scores = scores.masked_fill(torch.arange(keys.shape[0]) >= inputs.row_kv_lens[t0 - inputs.rows.start:
                                                                                             t1 - inputs.rows.start, None],
                                        float("-inf"))
            top = scores.topk(min(8, keys.shape[0]), dim=-1).indices
            top = torch.where(scores.gather(1, top) > float("-inf"), top, -1)
            out[t0 - inputs.rows.start:t1 - inputs.rows.start, :, : top.shape[1]] = top[:, None, :].to(torch.int32)
        return SparseRuntimeParams.from_topk(out)


def _answers(h: Harness, selector: SparseSelector, q, k, v, step, dsa: list[IndexerInputs] | None, hooked: bool):
    """The selector's ``predict_kv`` and ``predict_attn`` answers on one step (``hooked``: the harness
    ran its plan's ``on_append``; otherwise the hooks run here)."""
    rids, lens, ctx = step
    inputs = h.hook_inputs(rids, lens, ctx, q, k, v, model_inputs=dsa)
    if not hooked:
        selector.on_append(inputs)
    kv = selector.predict_kv(inputs) if ctx else None
    attn = selector.predict_attn(inputs) if inputs.phases else None
    h.engine.end_step()
    return kv, attn, inputs.num_rows


def _same_for_head(full, shard, head: int) -> list[str]:
    """What differs between KV head ``head`` of the all-heads answers and head 0 of the shard's."""
    (kv_f, attn_f, rows), (kv_s, attn_s, _) = full, shard
    diffs = []
    if (kv_f is None) != (kv_s is None) or (kv_f is not None and not (
            torch.equal(kv_f[0][head], kv_s[0][0]) and torch.equal(kv_f[1], kv_s[1]))):
        diffs.append("predict_kv")
    if (attn_f is None) != (attn_s is None):
        return diffs + ["predict_attn answered on one side only"]
    if attn_f is None:
        return diffs
    for f in ("selected_phases", "sparse_attn_indices_block_size", "threshold_scale_factor_context",
              "threshold_scale_factor_generation"):
        if getattr(attn_f, f) != getattr(attn_s, f):
            diffs.append(f)
    if (attn_f.sparse_attn_indices is None) != (attn_s.sparse_attn_indices is None):
        diffs.append("sparse_attn_indices on one side only")
    elif attn_f.sparse_attn_indices is not None:
        full_sets = [s[head] for s in selection_sets(attn_f, rows, HKV)]
        if full_sets != [s[0] for s in selection_sets(attn_s, rows, 1)]:
            diffs.append("selection")
    return diffs


def shard_differences(name: str, params: dict, selector_cls: type | None = None) -> list[str]:
    """Run selector ``name`` (or ``selector_cls``'s hooks on layers planned with ``name``) over
    :data:`STEPS` on all ``HKV`` heads and on each one-KV-head shard (its query group with it);
    return what differed, per step and head (empty: per KV head)."""
    gen = torch.Generator().manual_seed(0)
    full = Harness(name, params, hkv=HKV, g=G, d=D)
    shards = [Harness(name, params, hkv=1, g=G, d=D) for _ in range(HKV)]
    sel_full = full.selector if selector_cls is None else selector_cls()
    sel_shards = [s.selector if selector_cls is None else selector_cls() for s in shards]
    hooked = selector_cls is None
    diffs = []
    for n, step in enumerate(STEPS):
        t = sum(step[1])
        q, k, v = torch.randn(t, HKV * G, D, generator=gen), torch.randn(t, HKV, D, generator=gen), \
            torch.randn(t, HKV, D, generator=gen)
        dsa = None
        if name in NEEDS_MODEL_INPUTS:
            heads, dim = params["n_heads"], params["head_dim"]
            dsa = IndexerInputs(q_index=torch.randn(t, heads, dim, generator=gen), k_index=torch.randn(t, dim, generator=gen),
                                weights=torch.rand(t, heads, generator=gen))
        ref = _answers(full, sel_full, q, k, v, step, dsa, hooked)
        for h, (shard, sel) in enumerate(zip(shards, sel_shards)):
            got = _answers(shard, sel, q[:, h * G:(h + 1) * G], k[:, h:h + 1], v[:, h:h + 1], step, dsa, hooked)
            diffs += [f"step {n} head {h}: {d}" for d in _same_for_head(ref, got, h)]
    return diffs


@pytest.mark.parametrize("name", sorted(DEFAULT_SELECTORS))
def test_builtin_declares_per_kv_head_and_holds_it(name):
    assert get_selector_class(name).capabilities.per_kv_head, f"{name} should declare per_kv_head=True"
    assert shard_differences(name, DEFAULT_SELECTORS[name]) == []


def test_a_selector_sharing_one_choice_across_heads_fails_the_check():
    assert not SharedTopK.capabilities.per_kv_head  # the default: not declared
    diffs = shard_differences("oracle_topk", DEFAULT_SELECTORS["oracle_topk"], SharedTopK)  # its phases
    assert diffs and all(d.endswith("selection") for d in diffs)
