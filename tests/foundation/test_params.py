"""Each validate() rule of SparseRuntimeParams has a test that names the field."""
from __future__ import annotations

import pytest
import torch

from kvsieve import SparseRuntimeParams
from kvsieve.sparse import is_dense

I32 = torch.int32


def attn(indices, offsets, bs=1, **kw):
    return SparseRuntimeParams(sparse_attn_indices=torch.tensor(indices, dtype=kw.pop("idt", I32)),
                               sparse_attn_offsets=torch.tensor(offsets, dtype=kw.pop("odt", I32)),
                               sparse_attn_indices_block_size=bs, **kw)


def test_valid_params_pass_and_from_topk_sorts_with_padding_tail():
    topk = torch.tensor([[[5, -1, 2]], [[0, 1, -1]]], dtype=I32)
    p = SparseRuntimeParams.from_topk(topk)
    assert p.sparse_attn_indices.tolist() == [[2, 5, -1, 0, 1, -1]]
    assert p.sparse_attn_offsets.tolist() == [0, 3, 6]
    p.validate(num_kv_heads=1, num_query_tokens=2, kv_lens=torch.tensor([6, 2]))


@pytest.mark.parametrize("params,match", [
    (lambda: attn([[1, 2]], [0, 2], idt=torch.int64), "sparse_attn_indices must be int32"),
    (lambda: attn([[1, 2]], [0, 2], odt=torch.int64), "sparse_attn_offsets must be int32"),
    (lambda: attn([[1, 2], [1, 2]], [0, 2]), r"sparse_attn_indices must have shape \[num_kv_heads=1"),
    (lambda: attn([[1, 2]], [0, -1]), "sparse_attn_offsets must be non-decreasing"),
    (lambda: attn([[1, 2]], [1, 2]), r"sparse_attn_offsets\[0\] must be 0"),
    (lambda: attn([[1, 2]], [0, 1]), r"sparse_attn_offsets\[-1\]=1 must equal"),
    (lambda: attn([[3, 2]], [0, 2]), "strictly ascending"),
    (lambda: attn([[2, 2]], [0, 2]), "strictly ascending"),
    (lambda: attn([[-1, 2]], [0, 2]), "padding must trail"),
    (lambda: attn([[-2, 2]], [0, 2]), "entries must be -1"),
    (lambda: attn([[1, 9]], [0, 2]), "out of range"),
    (lambda: attn([[1, 2]], [0, 2], bs=0), "sparse_attn_indices_block_size must be >= 1"),
    (lambda: attn([[1, 2]], [0, 2], threshold_scale_factor_context=-1.0), "threshold_scale_factor_context"),
    (lambda: attn([[1, 2]], [0, 2], threshold_scale_factor_generation=float("nan")),
     "threshold_scale_factor_generation must be a finite"),
    (lambda: attn([[1, 2]], [0, 2], selected_phases=frozenset({"prefill"})), "selected_phases"),
    (lambda: SparseRuntimeParams(sparse_attn_indices=torch.zeros(1, 1, dtype=I32)), "given together"),
    (lambda: SparseRuntimeParams(sparse_kv_indices=torch.tensor([[3, 1]], dtype=I32),
                                 sparse_kv_offsets=torch.tensor([0, 2], dtype=I32)), "sparse_kv_indices must be strictly"),
    (lambda: SparseRuntimeParams(sparse_kv_indices=torch.tensor([[-1, 1]], dtype=I32),
                                 sparse_kv_offsets=torch.tensor([0, 2], dtype=I32)), "sparse_kv_indices entries must be a position"),
])
def test_each_rule_raises_naming_the_field(params, match):
    with pytest.raises(ValueError, match=match):
        params().validate(num_kv_heads=1, num_query_tokens=1, num_contexts=1, kv_lens=torch.tensor([4]),
                          prompt_lens=torch.tensor([4]))


def test_wrong_row_count_and_block_range():
    with pytest.raises(ValueError, match="3 entries"):
        attn([[1, 2]], [0, 2]).validate(num_kv_heads=1, num_query_tokens=2)
    # block size 4, kv_len 9 -> blocks 0..2 valid, block 3 out of range
    attn([[0, 2]], [0, 2], bs=4).validate(num_kv_heads=1, kv_lens=torch.tensor([9]))
    with pytest.raises(ValueError, match=r"block \(size 4\)"):
        attn([[0, 3]], [0, 2], bs=4).validate(num_kv_heads=1, kv_lens=torch.tensor([9]))


def test_params_are_frozen():
    p = SparseRuntimeParams()
    with pytest.raises(Exception):
        p.threshold_scale_factor_context = 1.0  # type: ignore[misc]


def test_phase_questions_of_the_carrier():
    p = attn([[1, 2]], [0, 2], selected_phases=frozenset({"generation"}), threshold_scale_factor_context=2.0)
    assert p.selects_positions("generation") and not p.selects_positions("context")
    assert p.threshold_scale_factor("context") == 2.0 and p.threshold_scale_factor("generation") == 0.0
    assert not is_dense(p, "context") and not is_dense(p, "generation") and is_dense(None, "context")
    assert is_dense(SparseRuntimeParams(sparse_kv_indices=torch.zeros(1, 0, dtype=I32),
                                        sparse_kv_offsets=torch.zeros(2, dtype=I32)), "context")
    with pytest.raises(ValueError, match="phase must be one of"):
        p.selects_positions("prefill")


def test_sort_padding_last_matches_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.int32, torch.int64):
        units = torch.randint(-1, 50, (3, 4, 7), generator=g).to(dtype)
        got = SparseRuntimeParams.sort_padding_last(units)
        assert got.dtype == dtype and got.shape == units.shape
        for seg_in, seg_out in zip(units.reshape(-1, 7).tolist(), got.reshape(-1, 7).tolist()):
            valid = sorted(v for v in seg_in if v >= 0)
            assert seg_out == valid + [-1] * (7 - len(valid))


def test_sort_padding_last_keeps_ordered_units_and_orders_the_rest():
    ordered = torch.tensor([[[0, 1, 5, 9, -1, -1], [3, 4, -1, -1, -1, -1]]], dtype=torch.int32)
    assert torch.equal(SparseRuntimeParams.sort_padding_last(ordered), ordered)
    # padding in the middle, a repeat, padding other than -1: each needs the sort
    for seg, want in (([0, -1, 2, 3], [0, 2, 3, -1]), ([1, 1, 2, -1], [1, 1, 2, -1]), ([4, -2, 1, 2], [1, 2, 4, -1]),
                      ([5, 2, -1, -1], [2, 5, -1, -1])):
        assert SparseRuntimeParams.sort_padding_last(torch.tensor([seg])).tolist() == [want]
        # one selection broadcast to three KV heads (stride 0): checked once, sorted for every head
        shared = torch.tensor([seg])[:, None].expand(-1, 3, -1)
        assert SparseRuntimeParams.sort_padding_last(shared).tolist() == [[want] * 3]


def test_row_slice_matches_a_plain_loop_and_refuses_a_carrier_without_indices():
    g = torch.Generator().manual_seed(1)
    lens = [3, 0, 2, 5, 1]
    off = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=I32)
    idx = torch.randint(-1, 9, (2, int(off[-1])), generator=g).to(I32)
    p = SparseRuntimeParams(sparse_attn_indices=idx, sparse_attn_offsets=off, threshold_scale_factor_context=0.5)
    for a in range(len(lens) + 1):
        for b in range(a, len(lens) + 1):
            part = p.row_slice(slice(a, b))
            assert part.sparse_attn_offsets.tolist() == [int(off[t]) - int(off[a]) for t in range(a, b + 1)]
            for t in range(a, b):
                o0, o1 = part.sparse_attn_offsets[t - a: t - a + 2].tolist()
                assert torch.equal(part.sparse_attn_indices[:, o0:o1], idx[:, off[t]:off[t + 1]])
            assert part.threshold_scale_factor_context == 0.5
    dense = SparseRuntimeParams(threshold_scale_factor_context=0.5)
    with pytest.raises(ValueError, match="row_slice needs sparse_attn_indices"):
        dense.row_slice(slice(0, 1))
    assert dense.sparse_attn_indices is None
