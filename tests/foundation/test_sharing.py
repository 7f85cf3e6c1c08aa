"""Block sharing in the ledger: forks (beams) share every block by reference and copy a block on
the first write into it (main and auxiliary pools); transformers-style reordering; prefix caching
by chained hashes with LRU eviction of unreferenced cached blocks; refusals that change nothing."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsieve.metadata import KVCacheManager, KVCacheSpec
from kvsieve.metadata.block_allocator import KVCacheCapacityError


def make(num_blocks: int = 24, **kw) -> KVCacheManager:
    base = dict(num_layers=2, num_blocks=num_blocks, tokens_per_block=4, num_kv_heads=2, head_dim=4,
                max_requests=4, max_blocks_per_seq=8)
    base.update(kw)
    return KVCacheManager(KVCacheSpec(**base))


def fill(m: KVCacheManager, rid: int, start: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write random K/V for positions [start, start+n) of ``rid`` in every layer; returns layer 1's."""
    g = torch.Generator().manual_seed(seed)
    slots = np.full(n, m.slot(rid), dtype=np.int32)
    for layer in range(m.spec.num_layers):
        k, v = torch.randn(n, 2, 4, generator=g), torch.randn(n, 2, 4, generator=g)
        m.write(layer, slots, np.arange(start, start + n), k, v)
    return k, v


def test_fork_shares_then_copies_the_partial_block_on_write_with_its_aux_rows() -> None:
    m = make()
    aux = m.add_aux_pool("summary", (3,), torch.float32)
    m.add_request(1, 6)
    fill(m, 1, 0, 6, seed=0)
    for layer, pool in enumerate(aux):
        pool[m.block_ids(1)] = torch.arange(6.0).view(2, 3) + layer
    parent_k = m.gather(0, 1)[0].clone()
    m.fork(1, 2)
    assert m.block_ids(2) == m.block_ids(1) and m.allocator.refcount[m.block_ids(1)].tolist() == [2, 2]
    m.append_tokens(2, 3)  # positions 6..8: the partial block 1 is copied, block 2 is new
    b1, b2 = m.block_ids(1), m.block_ids(2)
    assert b2[0] == b1[0] and b2[1] != b1[1] and len(b2) == 3
    assert m.allocator.refcount[b1].tolist() == [2, 1]
    for layer in range(2):
        assert torch.equal(m.pools[layer][b2[1]], m.pools[layer][b1[1]])
        assert torch.equal(aux[layer][b2[1]], aux[layer][b1[1]])
    fill(m, 2, 6, 3, seed=1)
    assert torch.equal(m.gather(0, 1)[0], parent_k), "the parent's history is untouched"
    assert torch.equal(m.gather(0, 2)[0][:6], parent_k)
    m.allocator.check()


def test_a_shared_block_is_never_written() -> None:
    m = make()
    m.add_request(1, 5)
    m.fork(1, 2)
    before = [p.clone() for p in m.pools]
    with pytest.raises(RuntimeError, match="shared or cached"):
        m.write(0, np.full(1, m.slot(2), dtype=np.int32), np.array([4]), torch.ones(1, 2, 4), torch.ones(1, 2, 4))
    with pytest.raises(RuntimeError, match="shared or cached"):
        m.compact(0, 2, torch.tensor([[0, 2], [1, 3]]))
    assert all(torch.equal(a, b) for a, b in zip(before, m.pools))


def test_reorder_moves_rows_by_reference() -> None:
    m = make()
    for rid, n in ((0, 5), (1, 9), (2, 2)):
        m.add_request(rid, n)
    tables = {rid: m.block_ids(rid) for rid in range(3)}
    m.reorder([0, 1, 2], [1, 1, 0])
    assert [m.block_ids(r) for r in range(3)] == [tables[1], tables[1], tables[0]]
    assert [m.valid_len(r) for r in range(3)] == [9, 9, 5]
    held = set(tables[0]) | set(tables[1])
    assert m.allocator.num_held == len(held), "request 2's old blocks were freed"
    m.allocator.check()
    with pytest.raises(ValueError, match="sources"):
        m.reorder([0, 1, 2], [0, 3, 1])
    assert [m.block_ids(r) for r in range(3)] == [tables[1], tables[1], tables[0]]


def test_prefix_reuse_whole_blocks_and_lru_eviction() -> None:
    m = make(num_blocks=9)  # 8 usable blocks of 4 tokens
    prompt = list(range(100, 111))  # 11 tokens: 2 full blocks + 3
    m.add_request(1, tokens=prompt)
    assert m.valid_len(1) == 0
    m.append_tokens(1, 11, tokens=prompt)
    k, _ = fill(m, 1, 0, 11, seed=2)
    m.cache_full_blocks([1])
    assert m.allocator.num_cached == 2
    m.free_request(1)
    assert m.allocator.num_held == 0 and m.allocator.num_free == 8 and m.allocator.num_cached == 2
    m.add_request(2, tokens=prompt[:9] + [7, 7])  # shares the first 2 blocks (8 tokens)
    assert m.valid_len(2) == 8 and m.allocator.num_held == 2
    assert torch.equal(m.gather(1, 2)[0], k[:8])
    m.add_request(3, tokens=prompt[:8])  # at most len - 1 positions: one block only
    assert m.valid_len(3) == 4
    m.add_request(4, tokens=[1, 2, 3] + prompt[3:])  # a different first block: the chain breaks
    assert m.valid_len(4) == 0
    m.free_request(2)
    m.free_request(3)
    m.free_request(4)
    first = m.allocator.lookup(m._cached_prefix(prompt)[1][0])
    m.add_request(5, 4 * 7)  # needs 7 of 8: the free ones first, then the oldest cached block
    assert m.allocator.num_cached == 1 and m.allocator.lookup(m._cached_prefix(prompt)[1][0]) == first
    m.allocator.check()


def test_a_tracked_request_takes_its_token_ids() -> None:
    m = make()
    m.add_request(1, tokens=[1, 2, 3])
    with pytest.raises(ValueError, match="tracked for prefix caching"):
        m.append_tokens(1, 3)
    with pytest.raises(ValueError, match="speculative"):
        m.reserve_tokens(1, 2)
    m.add_request(2, 3)
    with pytest.raises(ValueError, match="without tokens"):
        m.append_tokens(2, 1, tokens=[5])
    assert m.valid_len(1) == 0 and m.valid_len(2) == 3


def test_refusals_for_lack_of_room_change_nothing() -> None:
    m = make(num_blocks=4, max_requests=2)  # 3 usable blocks
    m.add_request(1, 6)
    m.fork(1, 2)
    state = (m.block_table.copy(), m.allocator.state())
    with pytest.raises(KVCacheCapacityError, match="out of request slots"):
        m.fork(1, 3)
    with pytest.raises(KVCacheCapacityError, match="out of blocks"):
        m.append_tokens(2, 3)  # a copy of the partial block + one new block: 2 > 1 free
    assert np.array_equal(state[0], m.block_table)
    assert m.allocator.state().refcount.tolist() == state[1].refcount.tolist()
    assert m.allocator.state().free == state[1].free
