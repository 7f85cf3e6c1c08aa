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
