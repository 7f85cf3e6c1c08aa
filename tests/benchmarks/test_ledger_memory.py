"""The ledger memory figures (benchmarks/ledger_memory.py) against block arithmetic."""
from __future__ import annotations

from benchmarks.ledger_memory import prefix_sharing, window_release


def test_prefix_sharing_holds_the_system_prompt_once() -> None:
    r = prefix_sharing(5, system_len=64, user_len=(3, 9), tpb=8)
    # private: each prompt in its own blocks; shared: the 8 system blocks once, then each request's
    # own blocks from its first block that is not a full system-prompt block
    per_prompt = [-(-n // 8) for n in r["prompt_lens"]]
    assert all(67 <= n <= 73 for n in r["prompt_lens"])
    assert r["private"] == sum(per_prompt)
    assert r["shared"] == 8 + sum(p - 8 for p in per_prompt)
    assert r["reused_tokens"] == 4 * 64


def test_window_release_keeps_the_window_blocks_only() -> None:
    model = dict(num_layers=4, window=32, full_layers=(3,), num_kv_heads=1, head_dim=4, dtype_bytes=2)
    r = window_release(200, decode=10, chunk=64, tpb=8, model=model)
    n = 210
    assert r["full_blocks_keep"] == r["full_blocks_release"] == r["windowed_blocks_keep"] == -(-n // 8)
    assert r["windowed_blocks_release"] == -(-n // 8) - (n + 1 - 32) // 8
    block = 2 * 8 * 4 * 2
    assert r["bytes_keep"] == (-(-n // 8)) * 4 * block
    assert r["peak_bytes_release"] >= r["bytes_release"]


def test_session_prefix_counts_match_block_arithmetic():
    """Through the session, every prompt after the first finds the 64-token system prompt (4 whole
    blocks of 16) cached and the model runs on the rest only; the live request holds as many blocks
    either way (the reused ones by reference)."""
    from benchmarks.ledger_memory import session_prefix

    r = session_prefix(3, 64, (5, 20), tpb=16)
    assert r["computed_plain"] == r["prompt_tokens"]
    assert r["computed_shared"] == r["prompt_tokens"] - 2 * 64
    assert r["reused_blocks"] == 2 * 4
    assert r["held_plain"] == r["held_shared"]
