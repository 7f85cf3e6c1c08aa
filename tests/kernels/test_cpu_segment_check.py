"""The native carrier checker (``kvsieve.kernels.segment_check``) against its plain twin: on
random carriers, valid and broken by each rule, the checker accepts exactly what the plain checks
accept, and a broken carrier raises the plain path's named error either way."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsieve.kernels.common.native import NativeUnavailable
from kvsieve.kernels.segment_check.plan import check_segments
from kvsieve.kernels.segment_check.naive import check_offsets_naive, check_segments_naive
from kvsieve.kernels.segment_check.native import segment_check_native


def _native_or_skip(*args, **kw) -> int:
    try:
        return segment_check_native(*args, **kw)
    except NativeUnavailable as e:
        pytest.skip(f"native library unavailable: {e}")


def _carrier(gen: np.random.Generator, heads: int, rows: int, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A valid carrier: per row a length, per (head, row) a sorted unique selection, -1 padded at its tail."""
    lens = gen.integers(1, 200, rows)
    counts = gen.integers(0, 9, rows)
    off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    idx = np.full((heads, int(off[-1])), -1, dtype=np.int32)
    for r in range(rows):
        units = -(-int(lens[r]) // bs)
        for h in range(heads):
            k = int(gen.integers(0, min(counts[r], units) + 1))
            idx[h, off[r]: off[r] + k] = np.sort(gen.choice(units, k, replace=False))
    return torch.from_numpy(idx), torch.from_numpy(off), torch.from_numpy(lens)


def _plain_accepts(idx: torch.Tensor, off: torch.Tensor, lens: torch.Tensor, bs: int, padding: bool) -> bool:
    try:
        check_offsets_naive("sparse_attn", idx, off)
        check_segments_naive("sparse_attn_indices", idx, off, lens, block_size=bs, allow_padding=padding)
    except ValueError:
        return False
    return True


def _break(gen: np.random.Generator, idx: torch.Tensor, off: torch.Tensor, lens: torch.Tensor, bs: int, rule: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    idx, off = idx.clone(), off.clone()
    if rule == 1:
        off[int(gen.integers(0, off.numel()))] += int(gen.choice([-1, 1]))
    elif idx.shape[1]:
        h, j = int(gen.integers(0, idx.shape[0])), int(gen.integers(0, idx.shape[1]))
        row = int(np.searchsorted(off.numpy(), j, side="right")) - 1
        idx[h, j] = {2: -2, 3: -(-int(lens[row]) // bs) + int(gen.integers(0, 3)),
                     4: int(idx[h, j - 1]) if j and int(idx[h, j - 1]) >= 0 else idx[h, j],
                     5: -1 if int(idx[h, j]) >= 0 else idx[h, j]}[rule]
    return idx, off


@pytest.mark.parametrize("bs", [1, 16])
def test_native_accepts_exactly_what_the_plain_checks_accept(bs: int) -> None:
    gen = np.random.default_rng(bs)
    seen = {True: 0, False: 0}
    for trial in range(300):
        idx, off, lens = _carrier(gen, heads=int(gen.integers(1, 4)), rows=int(gen.integers(1, 6)), bs=bs)
        if trial % 2:
            idx, off = _break(gen, idx, off, lens, bs, rule=int(gen.integers(1, 6)))
        for padding in (True, False):
            plain = _plain_accepts(idx, off, lens, bs, padding)
            lowest = -1 if padding else 0
            native = _native_or_skip(idx.numpy(), off.numpy(), lens.numpy().astype(np.int64), block_size=bs,
                                     lowest=lowest)
            assert (native == 0) == plain, (trial, padding, native)
            seen[plain] += 1
            if not plain:  # the public entry names the entry, as the plain path does
                with pytest.raises(ValueError, match="sparse_attn"):
                    check_segments("sparse_attn", idx, off, lens, block_size=bs, allow_padding=padding)
            else:
                check_segments("sparse_attn", idx, off, lens, block_size=bs, allow_padding=padding)
    assert min(seen.values()) > 50  # both outcomes were exercised


def test_without_lengths_only_the_range_rule_is_off() -> None:
    idx = torch.tensor([[0, 999, -1]], dtype=torch.int32)
    off = torch.tensor([0, 3], dtype=torch.int32)
    assert _native_or_skip(idx.numpy(), off.numpy(), None, block_size=1, lowest=-1) == 0
    check_segments("sparse_attn", idx, off, None, block_size=1, allow_padding=True)
    with pytest.raises(ValueError, match="out of range"):
        check_segments("sparse_attn", idx, off, torch.tensor([10]), block_size=1, allow_padding=True)


def test_a_lengths_count_that_does_not_match_the_rows_is_refused_before_the_checker_reads() -> None:
    idx, off = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="expected 2 valid lengths, got 1"):
        check_segments("sparse_attn", idx, off, torch.tensor([4]), block_size=1, allow_padding=True)
