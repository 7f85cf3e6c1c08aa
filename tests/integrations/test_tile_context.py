"""``KvsieveSession.tile_context``: a long context without its prefill (the e2e benchmark's hook; that
it repeats K/V and the auxiliary pools block for block is tests/benchmarks' e2e tiling test). Each
refusal names its reason and leaves the session as it was."""
from __future__ import annotations

import pytest
import torch

from kvsieve import SparseAttentionConfig
from kvsieve.eval.model import tiny_random_llama
from kvsieve.integrations.transformers import KvsieveSession

from families import build


def _state(session: KvsieveSession) -> tuple:
    cache = session.cache
    return (session.num_cached_positions, [cache.valid_len(r) for r in cache.request_ids],
            [cache.block_ids(r) for r in cache.request_ids])


def test_tiling_every_row_then_decoding_continues_from_the_new_length():
    with KvsieveSession(tiny_random_llama(), SparseAttentionConfig("quest", {"budget": 16}), backend="torch",
                        max_tokens=128) as session:
        session.prefill(torch.randint(0, 256, (2, 32)))
        session.tile_context(96)
        assert session.num_cached_positions == 96
        assert [session.cache.valid_len(r) for r in (0, 1)] == [96, 96]
        session.tile_context(96)  # already that long: nothing to add
        assert session.decode(torch.tensor([1, 2])).shape[0] == 2
        assert session.num_cached_positions == 97


@pytest.mark.parametrize("prompt,length,error,message", [
    (None, 64, RuntimeError, r"tile_context: no live requests \(prefill first\)"),
    (32, 16, ValueError, r"tile_context: length must be in \[32 \(the cached positions\), 96 \(max_tokens\)\], got 16"),
    (32, 97, ValueError, r"length must be in \[32 .*, got 97"),
    (30, 64, ValueError, r"tile_context: the 30 cached positions are not whole blocks of 16"),
])
def test_refusals_name_their_reason_and_change_nothing(prompt, length, error, message):
    with KvsieveSession(tiny_random_llama(), None, backend="torch", max_tokens=96) as session:
        if prompt is not None:
            session.prefill(torch.randint(0, 256, (1, prompt)))
        before = _state(session)
        with pytest.raises(error, match=message):
            session.tile_context(length)
        assert _state(session) == before


def test_prefix_caching_and_cache_groups_are_refused():
    with KvsieveSession(tiny_random_llama(), None, backend="torch", max_tokens=96, prefix_caching=True) as session:
        session.prefill(torch.randint(0, 256, (1, 32)))
        before = _state(session)
        with pytest.raises(ValueError, match=r"tile_context: the requests are tracked for prefix caching"):
            session.tile_context(64)
        assert _state(session) == before
    with KvsieveSession(build("gemma3")[0], None, backend="torch", max_tokens=96) as session:
        session.prefill(torch.randint(0, 96, (1, 32)))
        with pytest.raises(ValueError, match=r"tile_context: the session has 2 cache groups"):
            session.tile_context(64)
        assert session.num_cached_positions == 32
