"""The per-(row, KV head) block tables (``kvsieve.kernels.head_tables``): native builder, naive
twin and a plain loop over rows and heads give the same tables and lengths on random whole-block
selections (rows of different lengths, padding, the newest block partial or not)."""
from __future__ import annotations

import numpy as np
import pytest

from kvsieve.kernels.common.native import NativeUnavailable
from kvsieve.kernels.head_tables.plan import head_tables
from kvsieve.kernels.head_tables.naive import head_tables_naive
from kvsieve.kernels.head_tables.native import head_tables_native


def _selection(gen: np.random.Generator, heads: int, n: int, bs: int):
    kv = gen.integers(1, 40 * bs, n).astype(np.int32)
    blocks = -(-kv // bs)
    counts = gen.integers(1, 7, n)
    off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    idx = np.full((heads, int(off[-1])), -1, dtype=np.int32)
    for r in range(n):
        for h in range(heads):
            k = int(gen.integers(1, min(counts[r], blocks[r]) + 1))
            idx[h, off[r]: off[r] + k] = np.sort(gen.choice(blocks[r], k, replace=False))
    table = gen.permutation(1000)[: n * 40].reshape(n, 40).astype(np.int32)
    return idx, off, table, kv


def _loop(idx, off, table, kv, bs):
    heads, n = idx.shape[0], off.size - 1
    width = int(np.diff(off).max())
    pseudo, seq = np.zeros((n * heads, width), np.int32), np.zeros(n * heads, np.int32)
    for r in range(n):
        for h in range(heads):
            chosen = [int(b) for b in idx[h, off[r]: off[r + 1]] if b >= 0]
            if not chosen:
                return None
            for j, b in enumerate(chosen):
                pseudo[r * heads + h, j] = table[r, b] * heads + h
            seq[r * heads + h] = sum(min(bs, int(kv[r]) - b * bs) for b in chosen)
    return pseudo, seq


@pytest.mark.parametrize("bs", [16, 128])
def test_native_naive_and_loop_agree(bs: int) -> None:
    gen = np.random.default_rng(bs)
    for _ in range(100):
        args = _selection(gen, heads=int(gen.integers(1, 5)), n=int(gen.integers(1, 9)), bs=bs)
        want = _loop(*args, bs)
        for got in (head_tables_naive(*args, bs), head_tables(*args, bs)):
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        try:
            native = head_tables_native(*args, bs)
        except NativeUnavailable as e:
            pytest.skip(f"native library unavailable: {e}")
        assert np.array_equal(native[0], want[0]) and np.array_equal(native[1], want[1])


def test_a_row_and_head_that_selects_nothing_gives_none() -> None:
    idx = np.array([[0, 1, -1, -1], [2, -1, -1, -1]], dtype=np.int32)
    off = np.array([0, 2, 4], dtype=np.int32)
    table = np.arange(10, dtype=np.int32).reshape(2, 5)
    kv = np.array([40, 40], dtype=np.int32)
    assert head_tables(idx, off, table, kv, 16) is None  # head 0 of row 1 selects nothing
    assert head_tables_naive(idx, off, table, kv, 16) is None


def test_mismatched_shapes_are_refused() -> None:
    idx, off = np.zeros((1, 2), np.int32), np.array([0, 1, 2], np.int32)
    with pytest.raises(ValueError, match="table rows"):
        head_tables(idx, off, np.zeros((1, 4), np.int32), np.array([4, 4], np.int32), 16)


@pytest.mark.parametrize("bad", [3, 9])  # block 3 starts at kv_len 48; block 9 is past the table row of 5
def test_a_block_past_the_rows_length_is_refused_by_both_builders(bad: int) -> None:
    idx = np.array([[0, bad]], dtype=np.int32)
    off = np.array([0, 2], dtype=np.int32)
    _refused_by_every_builder(idx, off, np.arange(5, dtype=np.int32).reshape(1, 5), np.array([48], dtype=np.int32))


def _refused_by_every_builder(idx, off, table, kv) -> None:
    for build in (head_tables, head_tables_naive):
        with pytest.raises(ValueError, match="past its row's kv_len"):
            build(idx, off, table, kv, 16)
    try:
        head_tables_native(idx, off, table, kv, 16)
    except NativeUnavailable as e:
        pytest.skip(f"native library unavailable: {e}")
    except ValueError as e:
        assert "past its row's kv_len" in str(e)
    else:
        raise AssertionError("the native builder read a block past the row")


def test_the_table_rows_width_bounds_a_block_not_its_stride() -> None:
    """A table that is a column slice of a wider array (rows further apart than their width): block 5
    lies past the row's 5 entries although the row's memory goes on; both builders refuse it."""
    wide = np.arange(20, dtype=np.int32).reshape(1, 20)
    table = wide[:, :5]  # row stride 20 entries, width 5
    _refused_by_every_builder(np.array([[0, 5]], dtype=np.int32), np.array([0, 2], dtype=np.int32), table,
                              np.array([400], np.int32))


def test_a_range_error_is_refused_even_after_a_row_that_selects_nothing() -> None:
    """Row 0 selects nothing (the tables would be unusable), row 1 a block past its length: both
    builders raise on the range error rather than answer ``None``."""
    idx = np.array([[-1, 7]], dtype=np.int32)
    off = np.array([0, 1, 2], dtype=np.int32)
    _refused_by_every_builder(idx, off, np.arange(20, dtype=np.int32).reshape(2, 10), np.array([40, 40], np.int32))
