"""Top-p (adaptive budget) of quest, block_select and dsa: per query and KV head the kept set is
the shortest prefix of the selector's own ranking whose *estimated* mass reaches p, capped by
the budget. Each expected set is computed here from the raw q/k, one (query, head) at a time,
with the estimate each selector documents:

* quest: softmax over the query's pages of Quest's bound ``sum_d max(q_d min_d, q_d max_d)``,
  averaged over the group's query heads; the newest page first;
* block_select: softmax over the visible blocks of the group-max block score (max logit);
  the forced blocks first and always kept;
* dsa: softmax over the visible tokens of the index logits ``sum_h w_h ReLU(q_h . k)``.
"""
from __future__ import annotations

import pytest
import torch

from kvsieve.selectors import IndexerInputs
from kvsieve.sparse.knobs import KnobError
from kvsieve.selectors.block_select.selector import BlockSelectConfig
from kvsieve.selectors.dsa.selector import DSAConfig
from kvsieve.selectors.quest.selector import QuestConfig

from kvsieve.sparse.selector_step import place_rows

from harness import Harness, reference_params, selection_sets

HKV, G, D = 2, 3, 16


def cut(ranked: list[int], mass: torch.Tensor, p: float, cap: int, always: int = 0) -> set[int]:
    """The first ``max(always, j)`` of ``ranked[:cap]``, ``j`` the shortest prefix reaching ``p``
    (``p = 1``: all of them)."""
    kept, acc = [], 0.0
    for u in ranked[:cap]:
        if p < 1.0 and acc >= p and len(kept) >= always:
            break
        kept.append(u)
        acc += float(mass[u])
    return set(kept)


def ranking(score: torch.Tensor, first: list[int]) -> list[int]:
    """``first`` then the other units by descending score, ties to the lower unit."""
    rest = [u for u in sorted(range(score.numel()), key=lambda u: (-float(score[u]), u)) if u not in first]
    return first + rest


def quest_expected(q_t, keys, page, p, cap_pages, sm_scale):
    """Kept pages per KV head of one decode query ``q_t [Hq, D]`` over ``keys [n, Hkv, D]``."""
    n = keys.shape[0]
    n_pages = -(-n // page)
    out = []
    for h in range(HKV):
        logits = torch.empty(G, n_pages)
        for j in range(n_pages):
            blk = keys[j * page: (j + 1) * page, h]
            for g in range(G):
                qg = q_t[h * G + g]
                logits[g, j] = torch.maximum(qg * blk.amin(0), qg * blk.amax(0)).sum() * sm_scale
        mass = torch.softmax(logits, dim=-1).mean(0)
        out.append(cut(ranking(mass, [n_pages - 1]), mass, p, cap_pages))
    return out


@pytest.mark.parametrize("p,budget", [(0.5, 64), (0.9, 64), (0.9, 24), (1.0, 512)])
def test_quest_keeps_the_smallest_page_prefix_reaching_p(p, budget):
    page = 4
    h = Harness("quest", {"budget": budget, "page_size": page, "summary_dtype": "float32", "top_p": p},
                hkv=HKV, g=G, d=D, tpb=16)
    gen = torch.Generator().manual_seed(3)
    lens = [37, 70, 101]
    hist = {}
    for rid, n in enumerate(lens):
        q, k, v = h.qkv(n, gen)
        h.engine.step([rid], [n], 1, [(q, k, v)])
        hist[rid] = k
    q, k, v = h.qkv(len(lens), gen)
    q = q * 3.0  # peaked, so that p < 1 keeps fewer pages than the cap
    inputs = h.hook_inputs(list(range(len(lens))), [1] * len(lens), 0, q, k, v)
    got = selection_sets(h.selector.predict_attn(inputs), len(lens), HKV)
    sizes = set()
    for t, rid in enumerate(range(len(lens))):
        keys = torch.cat([hist[rid], k[t:t + 1]])
        want = quest_expected(q[t], keys, page, p, budget // page, D ** -0.5)
        assert got[t] == want, (t, p, budget)
        sizes |= {len(s) for s in want}
        if p == 1.0:  # everything up to the cap: plain top-budget (the whole context here)
            assert all(s == set(range(-(-keys.shape[0] // page))) for s in got[t])
    if p < 1.0 and budget >= 64:
        assert len(sizes) > 1
    assert max(sizes) <= budget // page


def block_expected(q, k, t, bs, p, cap, init, local, sm_scale):
    n = t + 1
    nb = -(-n // bs)
    out = []
    for h in range(HKV):
        logits = q[t, h * G:(h + 1) * G] @ k[:n, h].T * sm_scale  # [G, n]
        score = torch.stack([logits[:, j * bs:(j + 1) * bs].max() for j in range(nb)])
        forced = sorted({j for j in range(nb) if j < init or j >= nb - local})
        mass = torch.softmax(score, dim=0)
        out.append(cut(ranking(score, forced), mass, p, cap, always=len(forced)))
    return out


@pytest.mark.parametrize("p,topk,init,local", [(0.5, 12, 0, 1), (0.9, 12, 1, 1), (0.8, 3, 0, 1), (0.3, 12, 2, 2),
                                               (1.0, 64, 0, 1)])
def test_block_select_keeps_the_smallest_block_prefix_reaching_p(p, topk, init, local):
    bs, n = 4, 60
    cfg = {"block_size": bs, "topk_blocks": topk, "init_blocks": init, "local_blocks": local, "top_p": p}
    h = Harness("block_select", cfg, hkv=HKV, g=G, d=D)
    q, k, v = h.qkv(n, torch.Generator().manual_seed(5))
    q = q * 3.0
    inputs = h.hook_inputs([0], [n], 1, q, k, v)
    got = selection_sets(h.selector.predict_attn(inputs), n, HKV)
    ref = selection_sets(h.selector.predict_attn_naive(inputs), n, HKV)
    sizes = set()
    for t in range(n):
        want = block_expected(q, k, t, bs, p, topk, init, local, D ** -0.5)
        assert got[t] == want == ref[t], (t, p)
        sizes |= {len(s) for s in want}
        if p == 1.0:
            assert all(s == set(range(-(-(t + 1) // bs))) for s in got[t])
    assert max(sizes) <= topk
    if p < 1.0 and topk >= 12:
        assert len(sizes) > 1


def test_block_select_top_p_one_equals_plain_top_k():
    """p = 1 with a cap below the context: exactly the fixed-budget selection."""
    n, cfg = 80, {"block_size": 4, "topk_blocks": 5}
    q, k, v = Harness("block_select", cfg, hkv=HKV, g=G, d=D).qkv(n, torch.Generator().manual_seed(8))
    sets = []
    for extra in ({}, {"top_p": 1.0}):
        h = Harness("block_select", cfg | extra, hkv=HKV, g=G, d=D)
        sets.append(selection_sets(h.selector.predict_attn(h.hook_inputs([0], [n], 1, q, k, v)), n, HKV))
    assert sets[0] == sets[1]


def test_dsa_keeps_the_smallest_token_prefix_reaching_p():
    nh, dh, n, cap, p = 4, 16, 70, 40, 0.7
    h = Harness("dsa", {"index_topk": cap, "n_heads": nh, "head_dim": dh, "rope_dim": 0, "index_k_dtype": "float32",
                        "top_p": p}, hkv=HKV, g=G, d=D)
    gen = torch.Generator().manual_seed(9)
    qi, ki, wi = torch.randn(n, nh, dh, generator=gen) * 2, torch.randn(n, dh, generator=gen), \
        torch.rand(n, nh, generator=gen)
    q, k, v = h.qkv(n, gen)
    inputs = h.hook_inputs([0], [n], 1, q, k, v, model_inputs=IndexerInputs(q_index=qi, k_index=ki, weights=wi))
    got = selection_sets(h.selector.predict_attn(inputs), n, HKV)
    logits = torch.einsum("th,ths->ts", wi, torch.einsum("thd,sd->ths", qi, ki).relu())
    sizes = set()
    for t in range(n):
        mass = torch.softmax(logits[t, : t + 1], dim=0)
        want = cut(ranking(logits[t, : t + 1], []), mass, p, cap)
        assert got[t] == [want] * HKV, t
        sizes.add(len(want))
    assert len(sizes) > 1 and max(sizes) <= cap
    assert h.selector.stats.short_path_steps == 0  # short rows were cut too, not all kept


@pytest.mark.parametrize("cls,owner", [(QuestConfig, "quest"), (BlockSelectConfig, "block_select"),
                                       (DSAConfig, "dsa")])
@pytest.mark.parametrize("value", [0.0, 1.5, float("nan"), True])
def test_bad_top_p_is_refused(cls, owner, value):
    with pytest.raises(KnobError, match=f"{owner}.top_p"):
        cls(top_p=value)


def test_fast_path_equals_reference_with_top_p():
    """quest's and block_select's references apply the same cut on a mixed batch."""
    for name, cfg in (("quest", {"budget": 64, "page_size": 4, "top_p": 0.6}),
                      ("block_select", {"block_size": 8, "topk_blocks": 8, "top_p": 0.6, "init_blocks": 1})):
        h = Harness(name, cfg, hkv=HKV, g=G, d=D)
        gen = torch.Generator().manual_seed(2)
        for rids, lens, ctx in (([1, 2], [90, 50], 2), ([3, 1, 2], [40, 1, 1], 1)):
            q, k, v = h.qkv(sum(lens), gen)
            inputs = h.hook_inputs(rids, lens, ctx, q * 3.0, k, v)
            fast, ref = place_rows(h.selector.predict_attn(inputs), inputs, name), reference_params(h.selector, inputs)
            assert (fast is None) == (ref is None) == (name == "quest" and ctx == len(rids))
            if fast is not None:
                assert fast.selected_phases == ref.selected_phases
                assert selection_sets(fast, sum(lens), HKV) == selection_sets(ref, sum(lens), HKV), name
            h.engine.end_step()
