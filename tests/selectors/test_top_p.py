"""oracle_topk's adaptive budget (top_p): per query and KV head the kept set is the smallest set,
in descending attention mass, whose mass reaches p of the group's total, capped by the budget;
checked against the exact mass computed here, one (query, head) at a time."""
from __future__ import annotations

import pytest
import torch

from kvsieve.sparse.knobs import KnobError
from kvsieve.selectors import OracleTopKConfig

from harness import Harness, selection_sets


def exact_top_p(q, k, t, h, g, kv_len, sm_scale, p, block_size, budget):
    """The expected set of query ``t``, KV head ``h``: group-summed softmax over ``[0, kv_len)``,
    pooled into units of ``block_size``, taken in descending mass until p of it is reached."""
    probs = torch.softmax((q[t, h * g:(h + 1) * g] @ k[:kv_len, h].T) * sm_scale, dim=-1).sum(0)  # [kv_len]
    units = torch.zeros(-(-kv_len // block_size)).index_add_(0, torch.arange(kv_len) // block_size, probs)
    order = units.argsort(descending=True).tolist()
    kept, acc = set(), 0.0
    for u in order[: budget // block_size]:
        if acc >= p * float(units.sum()):
            break
        kept.add(u)
        acc += float(units[u])
    return kept


@pytest.mark.parametrize("p,block_size,budget", [(0.5, 1, 64), (0.9, 1, 64), (0.9, 1, 6), (0.8, 4, 32), (1.0, 1, 512)])
def test_kept_set_is_the_smallest_reaching_p(p, block_size, budget):
    hkv, g, d, n = 2, 3, 16, 40
    h = Harness("oracle_topk", {"budget": budget, "block_size": block_size, "top_p": p}, hkv=hkv, g=g, d=d)
    gen = torch.Generator().manual_seed(11)
    q, k, v = h.qkv(n, gen)
    q = q * 3.0  # peaked enough that p < 1 keeps far fewer than all
    inputs = h.hook_inputs([0], [n], 1, q, k, v)
    params = h.selector.predict_attn(inputs)
    got = selection_sets(params, n, hkv)
    sizes = []
    for t in range(n):
        for head in range(hkv):
            want = exact_top_p(q, k, t, head, g, t + 1, d ** -0.5, p, block_size, budget)
            assert got[t][head] == want, (t, head)
            sizes.append(len(want))
    if p < 1.0 and budget >= 64:  # adaptive: the kept count varies with the query
        assert len(set(sizes)) > 1
    if p == 1.0:  # everything with mass, up to the budget: the whole causal prefix
        assert all(got[t][hd] == set(range(t + 1)) for t in range(n) for hd in range(hkv))


@pytest.mark.parametrize("value", [0.0, -0.1, 1.5, float("nan"), True])
def test_bad_top_p_is_refused(value):
    with pytest.raises(KnobError, match="oracle_topk.top_p"):
        OracleTopKConfig(top_p=value)


def test_achieved_sparsity_is_reported():
    """Through the layer: LayerStats.attended is the sum of the kept sets, below the fixed budget's."""
    hkv, g, d, n = 2, 3, 16, 48
    attended = {}
    for top_p in (None, 0.6):
        h = Harness("oracle_topk", {"budget": 32, "top_p": top_p}, hkv=hkv, g=g, d=d)
        q, k, v = h.qkv(n, torch.Generator().manual_seed(5))
        (res,) = h.engine.step([0], [n], 1, [(q * 3.0, k, v)])
        attended[top_p] = res.stats.attended
        if top_p is not None:
            kept = h.selector.predict_attn(h.hook_inputs([1], [n], 1, q * 3.0, k, v))
            sizes = sum(len(s) for row in selection_sets(kept, n, hkv) for s in row)
            assert res.stats.attended == sizes
    assert 0 < attended[0.6] < attended[None]
