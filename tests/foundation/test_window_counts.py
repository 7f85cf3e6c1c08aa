"""A dense windowed layer's attended counts, taken from the lengths, equal the counts of the
window's selection (window_params), which the dense fast path no longer builds."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsieve.metadata import AttentionMetadata, KVCacheManager, KVCacheSpec
from kvsieve.sparse.selection import attended_counts
from kvsieve.sparse.window import window_counts, window_params


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("window", [1, 5, 16, 40])
@pytest.mark.parametrize("page", [1, 4, 16])
def test_window_counts_equal_the_counts_of_the_window_selection(seed, window, page):
    rng = np.random.default_rng(seed)
    m = KVCacheManager(KVCacheSpec(num_layers=1, num_blocks=120, tokens_per_block=16, num_kv_heads=2, head_dim=4,
                                   max_requests=6, max_blocks_per_seq=8))
    rids, lens = [1, 2, 3, 4], []
    for i, rid in enumerate(rids):  # two prompts, then two decodes of longer histories
        if i < 2:
            n = int(rng.integers(1, 60))
            m.add_request(rid, n)
        else:
            m.add_request(rid, int(rng.integers(1, 100)))
            n = 1
            m.append_tokens(rid, n)
        lens.append(n)
    md = AttentionMetadata(kv_cache_manager=m, max_num_requests=6, max_num_tokens=256)
    md.request_ids, md.seq_lens, md.num_contexts = rids, lens, 2
    md.prepare()
    want = attended_counts(window_params(None, md, 2, window), md.token_kv_lens, 2, page)
    got = window_counts(md.token_kv_lens, 2, window, page)
    assert got.dtype == torch.int64 and torch.equal(got, want)
