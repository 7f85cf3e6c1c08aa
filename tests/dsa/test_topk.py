"""Top-k engines: references on the full length sweep against ``torch.topk`` (exact value
multisets), the Triton kernels under the interpreter on representative rows (equal to their
references position for position), and the dispatch predicate."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from kvsieve.kernels.topk import plan
from kvsieve.kernels.topk import naive

LENGTHS = (1, 2, 127, 128, 129, 511, 512, 1000, 1023, 1024, 2047, 2048, 2049, 4096, 9295, 32768, 131072)
KS = (128, 512, 1024, 2048)


def _rows(n: int, seed: int, count: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` (<= 4) rows of width n: random, heavy ties (5 values), -inf sprinkled with
    ties, and a row whose valid length is shorter than the width (and holds -0.0)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(4, n, generator=g)
    s[1] = torch.randint(0, 5, (n,), generator=g).float()
    s[2] = torch.randint(0, 3, (n,), generator=g).float()
    s[2, torch.rand(n, generator=g) < 0.4] = float("-inf")
    s[3, ::7] = -0.0
    lens = torch.tensor([n, n, n, max(1, n // 3)], dtype=torch.int32)
    return s[:count].contiguous(), lens[:count]


def _check_against_torch(scores, lens, got, k) -> None:
    for r in range(scores.shape[0]):
        n = int(lens[r])
        kk = min(k, n)
        want = scores[r, :n].topk(kk).values.sort().values
        sel = got[r][got[r] >= 0].long()
        assert sel.numel() == kk and bool((got[r, kk:] == -1).all()), f"row {r}: {sel.numel()} valid, want {kk}"
        assert len(set(sel.tolist())) == kk and int(sel.max()) < n
        assert torch.equal(scores[r, sel].sort().values, want), f"row {r} n={n} k={k}: value multisets differ"


@pytest.mark.parametrize("n", LENGTHS)
def test_references_match_torch_topk(n):
    scores, lens = _rows(n, n)
    for k in KS:
        radix = naive.radix_topk(scores, lens, k)
        _check_against_torch(scores, lens, radix, k)
        by_torch = naive.torch_topk(scores, lens, k)
        _check_against_torch(scores, lens, by_torch, k)
        assert torch.equal(by_torch.sort(dim=1).values, radix.sort(dim=1).values)  # the same tie rule
        # the tie rule: ascending positions, lowest positions kept among threshold ties
        valid = radix >= 0
        assert bool((radix[:, 1:][valid[:, 1:]] > radix[:, :-1][valid[:, 1:]]).all())
        if n > k and n in (2049, 9295, 131072):  # GVR reference is a per-row loop: a subset of lengths
            assert torch.equal(naive.gvr_topk(scores, lens, k, 4 * k), radix)


def test_tie_rule_keeps_lowest_positions():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 3.0]])
    lens = torch.tensor([6], dtype=torch.int32)
    assert naive.radix_topk(scores, lens, 3).tolist() == [[1, 2, 4]]
    assert naive.torch_topk(scores, lens, 3).tolist() == [[1, 2, 4]]


def test_torch_engine_choice_does_not_depend_on_the_row_width():
    """The same query's scores in a wider row (more columns past its length, as when its step holds
    longer requests) select the same positions: DSA's choice does not depend on the step's batch."""
    g = torch.Generator().manual_seed(0)
    row = torch.randint(0, 3, (1, 300), generator=g).float()  # heavy ties, as the indexer's ReLU zeros
    lens = torch.tensor([300], dtype=torch.int32)
    narrow = naive.torch_topk(row, lens, 64)
    for width in (301, 512, 4096):
        wide = torch.cat([row, torch.randn(1, width - 300, generator=g)], dim=1)
        assert torch.equal(naive.torch_topk(wide, lens, 64).sort().values, narrow.sort().values)


@pytest.mark.parametrize("n,k", [(1, 128), (300, 128), (2049, 2048), (9295, 512), (131072, 2048)])
def test_triton_kernels_equal_references(n, k):
    from kvsieve.kernels.topk import triton as kernel

    scores, lens = _rows(n, 7 * n + k, count=2 if n > 100000 else 4)  # the long row: 2 rows (interpreter time)
    want = naive.radix_topk(scores, lens, k)
    got = kernel.radix_topk(scores, lens, k, block=4096, num_programs=2, num_warps=4)
    assert torch.equal(got, want)
    stats, ref_stats = (torch.zeros(scores.shape[0], dtype=torch.int32) for _ in range(2))
    ws = torch.zeros(2, 3, 4 * k, dtype=torch.int32)
    got = kernel.gvr_topk(scores, lens, k, 4 * k, workspace=ws, block=4096, num_warps=4, stats=stats)
    assert torch.equal(got, want)
    assert torch.equal(naive.gvr_topk(scores, lens, k, 4 * k, stats=ref_stats), want)
    assert torch.equal(stats, ref_stats)  # same guess, same verify outcome


def test_gvr_guess_fallback_is_exact():
    """All-equal rows defeat the guess (every entry is a candidate, beyond the scratch capacity):
    the kernel records the fallback and stays exact."""
    from kvsieve.kernels.topk import triton as kernel

    scores = torch.zeros(2, 5000)
    scores[1, 4000:] = 1.0
    lens = torch.tensor([5000, 5000], dtype=torch.int32)
    stats = torch.zeros(2, dtype=torch.int32)
    got = kernel.gvr_topk(scores, lens, 128, 512, workspace=torch.zeros(2, 2, 512, dtype=torch.int32), block=4096,
                          num_warps=4, stats=stats)
    assert stats.tolist() == [1, 1]
    assert got[0].tolist() == list(range(128)) and got[1].tolist() == list(range(4000, 4128))


def test_dispatch_table():
    choose = plan.choose_topk_engine
    assert choose("auto", device="cpu", index_topk=2048).engine == "torch"
    for sm in (90, 100, 103):
        assert choose("auto", device="cuda", index_topk=2048, cute_available=True, sm=sm).engine == "cute_gvr"
    for kw in (dict(sm=120), dict(sm=80), dict(index_topk=256), dict(compress_ratio=2), dict(cute_available=False)):
        args = dict(device="cuda", index_topk=1024, cute_available=True, sm=100) | kw
        d = choose("auto", **args)
        assert d.engine == "gvr" and "CuTe-DSL GVR" in d.reason
    assert choose("auto", device="cuda", index_topk=512, compress_ratio=4, cute_available=True, sm=100).engine \
        == "cute_gvr"
    assert choose("radix", device="cpu", index_topk=64).engine == "radix"  # TRITON_INTERPRET=1 in these tests


def test_dispatch_refuses_what_cannot_run(monkeypatch):
    with pytest.raises(ValueError, match="CuTe-DSL GVR kernel is unavailable"):
        plan.choose_topk_engine("cute_gvr", device="cuda", index_topk=2048, cute_available=False, sm=100)
    with pytest.raises(ValueError, match="index_topk must be in"):
        plan.choose_topk_engine("cute_gvr", device="cuda", index_topk=300, cute_available=True, sm=100)
    with pytest.raises(ValueError, match="SM in"):
        plan.choose_topk_engine("cute_gvr", device="cpu", index_topk=2048, cute_available=True)
    with pytest.raises(ValueError, match="topk_engine"):
        plan.choose_topk_engine("bitonic", device="cpu", index_topk=2048)
    # the kernel module ships; whether it can be launched depends on the CuTe-DSL package alone
    assert plan.cute_dsl_available() == (importlib.util.find_spec("cutlass") is not None)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="Triton kernel"):
        plan.choose_topk_engine("gvr", device="cpu", index_topk=2048)


@pytest.mark.parametrize("engine", ["torch", "radix", "gvr"])
def test_run_topk_through_workspace(engine):
    scores, lens = _rows(3000, 3)
    d = plan.choose_topk_engine(engine, device="cpu", index_topk=512)
    ws = plan.TopKWorkspace(d, max_rows=8, device="cpu")
    assert (ws.scratch is not None) == (engine == "gvr")
    got = plan.run_topk(ws, scores, lens)
    _check_against_torch(scores, lens, got, 512)
    with pytest.raises(ValueError, match="max_rows"):
        plan.run_topk(ws, torch.zeros(9, 10), torch.zeros(9, dtype=torch.int32))
