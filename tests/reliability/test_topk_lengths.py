"""Top-k engines with a length above the row width read the width (docs/dsa.md), never past the row;
a short row (length <= k) gives ``0..n-1`` then ``-1`` from every engine, the torch one included."""
from __future__ import annotations

import pytest
import torch

from kvsieve.kernels.topk import naive, plan


def _engines():
    def radix(s, l, k):
        from kvsieve.kernels.topk import triton as kernel
        return kernel.radix_topk(s, l, k, block=64, num_programs=4, num_warps=4)

    def gvr(s, l, k):
        from kvsieve.kernels.topk import triton as kernel
        ws = torch.empty(2, 4, 4 * k, dtype=torch.int32)
        return kernel.gvr_topk(s, l, k, 4 * k, workspace=ws, block=64, num_warps=4)

    return {"torch": naive.torch_topk, "radix_reference": naive.radix_topk,
            "gvr_reference": lambda s, l, k: naive.gvr_topk(s, l, k, 4 * k), "radix": radix, "gvr": gvr}


ENGINES = ["torch", "radix_reference", "gvr_reference", "radix", "gvr"]


@pytest.mark.parametrize("engine", ENGINES)
def test_length_above_the_row_width_reads_the_width(engine):
    """The rows are views into one buffer whose next row holds huge values: reading past the row
    would pick them."""
    g = torch.Generator().manual_seed(0)
    width, k = 40, 8
    buf = torch.randn(3, width, generator=g)
    buf[1] += 1000.0  # row 1 is what reading past row 0 would see
    scores = buf.clone()
    lengths = torch.tensor([width + 30, width * 5, width], dtype=torch.int32)
    got = _engines()[engine](scores[:2], lengths[:2], k)
    want = naive.radix_topk(scores[:2], torch.tensor([width, width], dtype=torch.int32), k)
    assert torch.equal(got.sort(1).values, want.sort(1).values)
    assert int(got.max()) < width


@pytest.mark.parametrize("engine", ENGINES)
def test_short_rows_give_positions_in_order_then_padding(engine):
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 32, generator=g)
    lengths = torch.tensor([5, 0, 16], dtype=torch.int32)
    got = _engines()[engine](scores, lengths, 16)
    want = torch.full((3, 16), -1, dtype=torch.int32)
    want[0, :5] = torch.arange(5)
    want[2] = torch.arange(16)
    assert torch.equal(got, want)


def test_run_topk_torch_engine_follows_the_short_row_contract():
    decision = plan.choose_topk_engine("torch", device="cpu", index_topk=8)
    ws = plan.TopKWorkspace(decision, 2, "cpu")
    scores = torch.stack([torch.tensor([0.1, 0.9, 0.5, -1.0] + [0.0] * 6), torch.arange(10, 0, -1).float()])
    got = plan.run_topk(ws, scores, torch.tensor([4, 20], dtype=torch.int32))
    assert got[0].tolist() == [0, 1, 2, 3, -1, -1, -1, -1]
    assert sorted(got[1].tolist()) == list(range(8))  # length 20 read as the width 10
