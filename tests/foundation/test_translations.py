"""Each translation of AttentionMetadata.prepare() checked against the ledger on random batches."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsieve.metadata import AttentionMetadata, KVCacheManager, KVCacheSpec, half_block_views


def random_batch(rng, page, speculative=False):
    m = KVCacheManager(KVCacheSpec(num_layers=1, num_blocks=600, tokens_per_block=page, num_kv_heads=1,
                                   head_dim=4, max_requests=16, max_blocks_per_seq=64))
    n_ctx, n_gen = int(rng.integers(0, 4)), int(rng.integers(1, 5))
    rids, seq = [], []
    for i in range(n_ctx):
        rid = 100 + i
        n = int(rng.integers(1, 3 * page + 5))
        m.add_request(rid, n)
        rids.append(rid)
        seq.append(n)
    for i in range(n_gen):
        rid = 200 + i
        hist = int(rng.integers(1, 6 * page))
        m.add_request(rid, hist)
        draft = int(rng.integers(1, 4)) if speculative else 1
        m.append_tokens(rid, draft)
        if speculative:
            m.reserve_tokens(rid, int(rng.integers(1, 2 * page + 2)))
        rids.append(rid)
        seq.append(draft)
    md = AttentionMetadata(kv_cache_manager=m, max_num_requests=16, max_num_tokens=512, max_num_sequences=64,
                           translations=("block_lists", "ragged_page_table", "block_offsets"))
    md.request_ids = rids
    md.seq_lens = seq
    md.num_contexts = n_ctx
    md.prepare()
    return m, md, rids, seq, n_ctx


PAGES = [1, 3, 16, 64]


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("seed", range(4))
def test_block_lists_and_ragged_table_match_ledger(page, seed):
    rng = np.random.default_rng(seed)
    m, md, rids, seq, n_ctx = random_batch(rng, page, speculative=seed % 2 == 1)
    rpt = md.ragged_page_table
    indptr = rpt.paged_kv_indptr.tolist()
    for b, rid in enumerate(rids):
        assert md.block_ids_per_seq[b] == m.block_ids(rid)
        valid = m.valid_len(rid)
        pages = -(-valid // page)
        assert indptr[b + 1] - indptr[b] == pages
        assert rpt.paged_kv_indices[indptr[b]: indptr[b + 1]].tolist() == m.block_ids(rid)[:pages]
    # batch indices and positions of new tokens: the last seq[b] positions of each request
    exp_b = np.repeat(np.arange(len(rids)), seq)
    exp_p = np.concatenate([np.arange(m.valid_len(r) - s, m.valid_len(r)) for r, s in zip(rids, seq)])
    assert rpt.batch_indices.tolist() == exp_b.tolist()
    assert md.positions.tolist() == exp_p.tolist()
    assert md.token_kv_lens.tolist() == (exp_p + 1).tolist()


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("seed", [1, 3])
@pytest.mark.parametrize("speculative", [False, True])
def test_block_offset_table_matches_ledger(page, seed, speculative):
    rng = np.random.default_rng(page * 10 + seed)
    m, md, rids, seq, n_ctx = random_batch(rng, page, speculative)
    t = md.block_offset_table
    dev = t.kv_cache_block_offsets
    rows = list(rids)  # one row per request, context requests first
    assert dev.shape[0] == 1 and t.num_rows == len(rows)
    longest = max(len(m.block_ids(r)) for r in rids)
    assert t.width == (m.spec.max_blocks_per_seq if speculative else longest)
    for r, rid in enumerate(rows):
        blocks = np.array(m.block_ids(rid))
        assert dev[0, r, 0, : len(blocks)].tolist() == (2 * blocks).tolist()
        assert dev[0, r, 1, : len(blocks)].tolist() == (2 * blocks + 1).tolist()
        pad = dev[0, r, :, len(blocks): t.width]  # padded entries point at the sentinel block 0
        assert bool((pad[0] == 0).all()) and bool((pad[1] == 1).all())
    assert np.array_equal(t.host[:, : t.num_rows, :, : t.width], t.last_snapshot)
    assert torch.equal(t.k_offsets, dev[0, : t.num_rows, 0, : max(t.width, 1)])


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_half_block_views_put_k_and_v_at_the_k_offset(layout):
    """A reader of the offsets (the Triton and CuTe GQA paths) finds K and V of block b at offset 2*b."""
    m = KVCacheManager(KVCacheSpec(num_layers=1, num_blocks=6, tokens_per_block=4, num_kv_heads=2, head_dim=8,
                                   layout=layout, max_requests=1, max_blocks_per_seq=4))
    m.pools[0].copy_(torch.randn(m.pools[0].shape))
    k_half, v_half = half_block_views(m.k_cache(0), m.v_cache(0))
    for b in range(6):
        assert torch.equal(k_half[2 * b], m.k_cache(0)[b]) and torch.equal(v_half[2 * b], m.v_cache(0)[b])


def test_snapshot_is_private_and_persistent_buffer_stays():
    rng = np.random.default_rng(0)
    m, md, rids, seq, n_ctx = random_batch(rng, 16)
    t = md.block_offset_table
    snap = t.last_snapshot
    before = snap.copy()
    t.host[:] = 7  # a later fill writes the persistent buffer; the in-flight snapshot is untouched
    assert np.array_equal(snap, before) and not np.shares_memory(snap, t.host)


def test_device_buffers_are_updated_in_place():
    rng = np.random.default_rng(1)
    m, md, rids, seq, n_ctx = random_batch(rng, 16)
    ptrs = (md._kv_lens_device.data_ptr(), md._token_to_req.data_ptr(), md._block_table_device.data_ptr(),
            md.ragged_page_table.paged_kv_indices_buf.data_ptr(), md.block_offset_table.device_buf.data_ptr())
    for rid in rids:
        m.append_tokens(rid, 1)
    md.seq_lens = [1] * len(rids)
    md.num_contexts = 0
    md.prepare()
    assert ptrs == (md._kv_lens_device.data_ptr(), md._token_to_req.data_ptr(), md._block_table_device.data_ptr(),
                    md.ragged_page_table.paged_kv_indices_buf.data_ptr(), md.block_offset_table.device_buf.data_ptr())
    assert md.kv_lens.tolist() == [m.valid_len(r) for r in rids]


def test_addressable_and_valid_lengths_are_separate():
    m = KVCacheManager(KVCacheSpec(num_layers=1, num_blocks=20, tokens_per_block=4, max_requests=2, max_blocks_per_seq=8))
    m.add_request(1, 6)
    m.reserve_tokens(1, 7)  # 13 addressable -> 4 pages; valid 6 -> 2 pages
    md = AttentionMetadata(kv_cache_manager=m, max_num_requests=2, max_num_tokens=8,
                           translations=("ragged_page_table", "block_offsets"))
    md.request_ids, md.seq_lens, md.num_contexts = [1], [1], 0
    md.prepare()
    assert md.kv_lens.tolist() == [6]
    assert md.ragged_page_table.paged_kv_indptr.tolist() == [0, 2]
    assert md.block_offset_table.width == 8  # speculative: whole row, reserved pages included
    assert md.block_table.shape[1] == 4


def test_derived_counts_and_cross_attention_identity():
    m = KVCacheManager(KVCacheSpec(num_layers=1, num_blocks=20, tokens_per_block=4, max_requests=4, max_blocks_per_seq=8))
    md = AttentionMetadata(kv_cache_manager=m, max_num_requests=4, max_num_tokens=32)
    md.seq_lens = [5, 3, 1, 1]
    md.num_contexts = 2
    assert (md.num_tokens, md.num_ctx_tokens, md.num_generations) == (10, 8, 2)
    assert (md.context_rows, md.generation_rows) == (slice(0, 8), slice(8, 10))
    assert (md.phase_requests("context"), md.phase_requests("generation")) == (slice(0, 2), slice(2, 4))
    assert md.phases() == ("context", "generation")
    md.num_contexts = 0
    assert md.phases() == ("generation",) and md.context_rows == slice(0, 0)
    md.num_contexts = 2
    with pytest.raises(ValueError, match="max_num_tokens"):
        md.seq_lens = [30, 30]
    with pytest.raises(ValueError, match="unknown"):
        AttentionMetadata(kv_cache_manager=m, max_num_requests=4, max_num_tokens=8, translations=("nope",))


def test_prepare_requires_appended_tokens():
    m = KVCacheManager(KVCacheSpec(num_layers=1, num_blocks=20, tokens_per_block=4, max_requests=4, max_blocks_per_seq=8))
    m.add_request(9, 2)
    md = AttentionMetadata(kv_cache_manager=m, max_num_requests=4, max_num_tokens=32)
    md.request_ids, md.seq_lens, md.num_contexts = [9], [5], 1
    with pytest.raises(ValueError, match="append the step's tokens"):
        md.prepare()


def _beam_batch(n_ctx: int, n_gen: int, width: int, page: int = 4):
    """A step of ``n_ctx`` new prompts and ``n_gen`` generation requests of ``width`` forked beams
    each (every beam then wrote one token of its own, so its last block was copied on write)."""
    m = KVCacheManager(KVCacheSpec(num_layers=1, num_blocks=200, tokens_per_block=page, num_kv_heads=1, head_dim=4,
                                   max_requests=16, max_blocks_per_seq=16))
    rids, seq = [], []
    for i in range(n_ctx):
        m.add_request(100 + i, 3 + 2 * i)
        rids.append(100 + i)
        seq.append(3 + 2 * i)
    for j in range(n_gen):
        parent = 200 + 10 * j
        m.add_request(parent, 5 + 3 * j)
        for b in range(1, width):
            m.fork(parent, parent + b)
        for b in range(width):
            m.append_tokens(parent + b, 1)
            rids.append(parent + b)
            seq.append(1)
    return m, rids, seq


def _offsets(m, rids, seq, n_ctx, width):
    md = AttentionMetadata(kv_cache_manager=m, max_num_requests=16, max_num_tokens=64, max_num_sequences=16,
                           translations=("block_offsets",))
    md.request_ids, md.seq_lens, md.num_contexts, md.beam_width = rids, seq, n_ctx, width
    md.prepare()
    t = md.block_offset_table
    return t.kv_cache_block_offsets[:, : t.num_rows, :, : t.width].clone()


@pytest.mark.parametrize("n_ctx,n_gen,width", [(0, 1, 3), (2, 2, 2), (1, 3, 4), (2, 0, 3)])
def test_beam_rows_lay_out_as_the_per_row_translation(n_ctx, n_gen, width):
    """Context rows once, then generation requests' beams in groups of beam_width: the table equals
    the per-row translation (beam_width 1) of the same rows, and row num_contexts + j*width + b
    holds beam b of generation request j (forked: shared blocks, its own last block)."""
    m, rids, seq = _beam_batch(n_ctx, n_gen, width)
    beams = _offsets(m, rids, seq, n_ctx, width)
    per_row = _offsets(m, rids, seq, len(rids) if not n_gen else n_ctx, 1)
    assert beams.shape[1] == n_ctx + n_gen * width
    assert torch.equal(beams, per_row)
    for j in range(n_gen):
        for b in range(width):
            blocks = np.array(m.block_ids(200 + 10 * j + b))
            assert beams[0, n_ctx + j * width + b, 0, : len(blocks)].tolist() == (2 * blocks).tolist()


def test_generation_rows_that_are_not_whole_beam_groups_are_refused():
    m, rids, seq = _beam_batch(1, 2, 2)
    md = AttentionMetadata(kv_cache_manager=m, max_num_requests=16, max_num_tokens=64, max_num_sequences=16,
                           translations=("block_offsets",))
    md.request_ids, md.seq_lens, md.num_contexts, md.beam_width = rids, seq, 1, 3
    before = md.block_offset_table.host.copy()
    with pytest.raises(ValueError, match="4 generation rows, not a multiple of beam_width=3"):
        md.prepare()
    assert not md.prepared and np.array_equal(md.block_offset_table.host, before)
    with pytest.raises(ValueError, match="beam_width must be an int >= 1"):
        md.beam_width = 0
