"""to_physical_slots, effective_attended_tokens, compaction, merge_states (interpreter)."""
from __future__ import annotations

import pytest
import torch

from conftest import F32_TOL, make_block_table, make_cache, make_selection
from kvsieve.kernels.common.indexing import effective_attended_tokens, to_physical_slots
from kvsieve.kernels.common.merge_states import naive as merge_naive
from kvsieve.kernels.common.merge_states.triton import merge_states
from kvsieve.kernels.compact_kv import naive
from kvsieve.kernels.compact_kv.triton import compact_kv_, compact_mla_kv_


@pytest.mark.parametrize("page,block", [(16, 1), (16, 16), (53, 1)])
def test_to_physical_slots(page, block):
    kv_lens = [100, 37, 160]
    idx, off = make_selection(kv_lens, 2, block, 6, n_beyond=0)
    tok = torch.tensor([1, 0, 2], dtype=torch.int32)
    bt = make_block_table(3, 200, page, 3 * (200 // page + 2) + 1)
    slots = to_physical_slots(idx, off, tok, bt, page, block)
    for h in range(2):
        for t in range(3):
            for e in range(int(off[t]), int(off[t + 1])):
                i = int(idx[h, e])
                want = -1 if i < 0 else int(bt[tok[t], i * block // page]) * page + i * block % page
                assert int(slots[h, e]) == want


@pytest.mark.parametrize("page,block", [(16, 1), (16, 4), (53, 64), (1, 128), (64, 4)])
def test_effective_attended_tokens(page, block):
    kv_lens = [300, 37, 1]
    idx, off = make_selection(kv_lens, 2, block, 5)
    eff = effective_attended_tokens(idx, off, torch.tensor(kv_lens, dtype=torch.int32),
                                    block, page)
    for t, kv_len in enumerate(kv_lens):
        for h in range(2):
            pages = set()
            for i in idx[h, int(off[t]):int(off[t + 1])].tolist():
                if i >= 0:
                    pages |= {p // page for p in range(i * block, (i + 1) * block) if p < kv_len}
            want = sum(min(page, kv_len - pg * page) for pg in pages)
            assert int(eff[t, h]) == want


@pytest.mark.parametrize("layout,page", [("HND", 16), ("NHD", 53)])
def test_compact_kv_in_place(layout, page):
    k, v = make_cache(12, 2, page, 32, layout=layout)
    bt = make_block_table(1, 150, page, 12)[0]
    g = torch.Generator().manual_seed(1)
    keep = torch.stack([torch.sort(torch.randperm(150, generator=g)[:70]).values
                        for _ in range(2)]).to(torch.int32)
    before_k = [[k[bt[p // page], h, p % page].clone() for p in keep[h].tolist()] for h in range(2)]
    k2, v2 = k.clone(), v.clone()
    compact_kv_(k, v, bt, keep)
    naive.compact_kv_(k2, v2, bt, keep)
    assert torch.equal(k, k2) and torch.equal(v, v2)
    for h in range(2):
        for j, row in enumerate(before_k[h]):
            assert torch.equal(k[bt[j // page], h, j % page], row)


def test_compact_mla_in_place():
    latent = torch.randn(10, 16, 80)
    bt = torch.tensor([4, 2, 7, 1], dtype=torch.int32)
    keep = torch.tensor([[0, 3, 17, 18, 40, 63]], dtype=torch.int32)
    ref = latent.clone()
    compact_mla_kv_(latent, bt, keep)
    naive.compact_mla_kv_(ref, bt, keep)
    assert torch.equal(latent, ref)


def test_merge_states_matches_naive():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(3, 4, 5, 24, generator=g)
    s = torch.randn(3, 4, 5, generator=g)
    s[0, 0] = float("inf")  # all states empty -> out 0, lse +inf
    s[1, 1, :3] = float("inf")
    o, l = merge_states(v, s)
    ro, rl = merge_naive.merge_states(v, s)
    torch.testing.assert_close(o, ro, **F32_TOL)
    torch.testing.assert_close(l, rl, **F32_TOL)
    assert torch.all(o[0, 0] == 0) and torch.isposinf(l[0, 0])
