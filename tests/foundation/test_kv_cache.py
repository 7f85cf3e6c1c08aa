from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsieve.metadata import BlockAllocator, KVCacheManager, KVCacheSpec


def make(layout="HND", kind="gqa", **kw):
    base = dict(num_layers=2, num_blocks=40, tokens_per_block=4, num_kv_heads=2, head_dim=8, layout=layout,
                kind=kind, max_requests=4, max_blocks_per_seq=12)
    if kind == "mla":
        base.update(kv_lora_rank=6, rope_dim=2)
    base.update(kw)
    return KVCacheManager(KVCacheSpec(**base))


def test_allocator_never_hands_out_sentinel_and_reports_exhaustion():
    a = BlockAllocator(5)
    got = a.allocate(4)
    assert sorted(got) == [1, 2, 3, 4] and 0 not in got
    with pytest.raises(RuntimeError, match="out of blocks"):
        a.allocate(1)
    a.release(got[:2])
    assert a.num_free == 2
    with pytest.raises(ValueError, match="block ids"):
        a.release([0])


def test_ledger_append_reserve_commit_rewind_free():
    m = make()
    m.add_request(11, 5)
    assert m.valid_len(11) == 5 and len(m.block_ids(11)) == 2
    m.reserve_tokens(11, 4)  # speculative drafts: addressable 9, valid 5
    s = m.slot(11)
    assert m.addressable_lens[s] == 9 and m.valid_lens[s] == 5 and len(m.block_ids(11)) == 3
    with pytest.raises(RuntimeError, match="uncommitted"):
        m.append_tokens(11, 1)
    m.commit_tokens(11, 2)
    assert m.valid_len(11) == 7
    with pytest.raises(ValueError, match="reserved"):
        m.commit_tokens(11, 5)
    m.rewind(11)
    assert m.addressable_lens[s] == 7 and len(m.block_ids(11)) == 2
    free_before = m.allocator.num_free
    m.free_request(11)
    assert m.allocator.num_free == free_before + 2
    with pytest.raises(KeyError, match="unknown request_id"):
        m.slot(11)


def test_sequence_longer_than_table_is_rejected():
    m = make()
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        m.add_request(1, 4 * 12 + 1)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_write_gather_roundtrip_and_views(layout):
    m = make(layout)
    m.add_request(1, 10)
    k, v = torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    s = np.full(10, m.slot(1), dtype=np.int32)
    m.write(1, s, np.arange(10), k, v)
    gk, gv = m.gather(1, 1)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    # the 4-D view addresses the same storage: position 6 is page 1, offset 2
    blk = m.block_ids(1)[1]
    assert torch.equal(m.k_cache(1)[blk, :, 2], k[6])
    assert m.k_cache(1).shape == (40, 2, 4, 8)
    assert torch.count_nonzero(m.pools[1][0]) == 0, "the sentinel block stays zero"


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_writes_equal_one_batched_write(layout, dtype):
    """A decode step's single-token write (basic indexing) lands where a batched write of the same
    tokens does, with the same cast; a position past the request's range raises and writes nothing."""
    one, batched = make(layout, dtype=dtype), make(layout, dtype=dtype)
    k, v = torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    for m in (one, batched):
        m.add_request(1, 9)
    s = np.full(9, one.slot(1), dtype=np.int32)
    batched.write(1, s, np.arange(9), k, v)
    for t in range(9):
        one.write(1, s[t: t + 1], np.array([t]), k[t: t + 1], v[t: t + 1])
    assert torch.equal(one.pools[1], batched.pools[1])
    before = one.pools[1].clone()
    with pytest.raises(ValueError, match=r"write: position 9 is outside .* \[0, 9\)"):
        one.write(1, s[:1], np.array([9]), k[:1], v[:1])
    assert torch.equal(one.pools[1], before)
    with pytest.raises(ValueError, match="GQA cache takes k and v"):
        one.write(1, s[:1], np.array([0]), k[:1])


def test_mla_latent_pool():
    m = make(kind="mla")
    m.add_request(3, 7)
    lat = torch.randn(7, 8)
    m.write(0, np.full(7, m.slot(3), dtype=np.int32), np.arange(7), lat)
    assert m.latent_cache(0).shape == (40, 4, 8)
    assert torch.equal(m.gather(0, 3)[0], lat)
    with pytest.raises(ValueError, match="MLA takes the latent"):
        m.write(0, np.array([m.slot(3)]), np.array([0]), lat[:1], lat[:1])


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_compact_in_place_per_head_then_truncate(layout):
    m = make(layout)
    m.add_request(5, 23)
    k, v = torch.randn(23, 2, 8), torch.randn(23, 2, 8)
    m.write(0, np.full(23, m.slot(5), dtype=np.int32), np.arange(23), k, v)
    kept = torch.tensor([[0, 3, 4, 9, 17, 22], [1, 2, 5, 6, 20, 21]], dtype=torch.int32)
    m.compact(0, 5, kept)
    m.truncate(5, 6)
    gk, gv = m.gather(0, 5)
    for h in range(2):
        assert torch.equal(gk[:, h], k[kept[h].long(), h])
        assert torch.equal(gv[:, h], v[kept[h].long(), h])
    assert len(m.block_ids(5)) == 2
    with pytest.raises(ValueError, match="ascending"):
        m.compact(0, 5, torch.tensor([[1, 0], [0, 1]], dtype=torch.int32))


def test_aux_pool_shares_block_ids():
    m = make()
    pools = m.add_aux_pool("kminmax", (2, 2, 8), torch.float16)
    assert len(pools) == 2 and pools[0].shape == (40, 2, 2, 8)
    assert m.add_aux_pool("kminmax", (2, 2, 8), torch.float16) is pools
    with pytest.raises(ValueError, match="exists with shape"):
        m.add_aux_pool("kminmax", (3,), torch.float16)


def test_spec_validation_names_the_field():
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheSpec(num_layers=1, num_blocks=1, tokens_per_block=4)
    with pytest.raises(ValueError, match="layout"):
        KVCacheSpec(num_layers=1, num_blocks=4, tokens_per_block=4, layout="XYZ")
    with pytest.raises(ValueError, match="dtype"):
        KVCacheSpec(num_layers=1, num_blocks=4, tokens_per_block=4, dtype=torch.int8)
