"""``top_units_topk`` (partial selection on distinct int keys) against ``top_units`` (full stable sort)."""
from __future__ import annotations

import pytest
import torch

from kvsieve.selectors.common.paged import top_units, top_units_topk


@pytest.mark.parametrize("k", [1, 5, 64])
def test_topk_matches_stable_sort_on_ties(k):
    gen = torch.Generator().manual_seed(k)
    # few distinct values (many ties), negatives, both zeros, -inf (invalid) and +inf
    values = torch.tensor([-3.5, -1e-30, -0.0, 0.0, 1e-30, 0.25, 2.0, float("inf"), float("-inf")])
    scores = values[torch.randint(0, len(values), (4, 3, 64), generator=gen)]
    assert torch.equal(top_units_topk(scores, k), top_units(scores, k))
    dense = torch.rand(4, 3, 2049, generator=gen)
    assert torch.equal(top_units_topk(dense, k), top_units(dense, k))


def test_other_dtypes_take_the_sort():
    scores = torch.tensor([[1.0, 3.0, 3.0, -2.0]], dtype=torch.float64)
    assert top_units_topk(scores, 3).tolist() == [[1, 2, 0]]
