"""The DSA indexer's projections of a step's few tokens (``kvsieve.kernels.indexer_project``): the
native kernel against its naive twin and against :class:`IndexerProjections` (the module the
selector runs otherwise), for bf16 and fp32 hidden states with strided rows, 1..MAX_TOKENS tokens,
hidden sizes and output counts off the kernel's 32-wide chunks, with and without the key's norm and
the RoPE; its values do not depend on the thread count; the selector projects a CPU decode step with
it (and everything else with the module); a shape the kernel does not take is refused before
anything is written."""
from __future__ import annotations

import ctypes

import pytest
import torch

from kvsieve.kernels.common.native import NativeUnavailable
from kvsieve.kernels.indexer_project.naive import indexer_project_naive
from kvsieve.kernels.indexer_project.native import (MAX_TOKENS, IndexerProjectCall, indexer_project_native,
                                                    pack_weight, supports_native)
from kvsieve.selectors.dsa.projections import IndexerProjections, rope_cos_sin


def _native_or_skip(*args):
    try:
        return indexer_project_native(*args)
    except NativeUnavailable as e:
        pytest.skip(f"native kernel unavailable: {e}")


def _module(hidden_size: int, h: int, d: int, r: int, norm: bool, seed: int) -> IndexerProjections:
    torch.manual_seed(seed)
    p = IndexerProjections(hidden_size, h, d, r, rope_theta=5e4, k_norm=norm)
    if norm:  # a trained norm is not the identity
        with torch.no_grad():
            p.k_norm.weight.uniform_(0.5, 1.5)
            p.k_norm.bias.uniform_(-0.2, 0.2)
    return p.eval()


def _args(p: IndexerProjections, hidden: torch.Tensor, positions: torch.Tensor, packed: torch.Tensor):
    norm = p.k_norm if isinstance(p.k_norm, torch.nn.LayerNorm) else None
    cos, sin = rope_cos_sin(positions, p.rope_dim, p.rope_theta) if p.rope_dim else (None, None)
    return (hidden, packed, None if norm is None else norm.weight.detach(), None if norm is None else norm.bias.detach(),
            1e-5 if norm is None else norm.eps, cos, sin, p.n_heads, p.head_dim, p.rope_dim,
            p.head_dim ** -0.5 * p.n_heads ** -0.5)


CASES = [  # hidden_size, heads, head_dim, rope_dim, norm, tokens
    (576, 8, 32, 16, True, 1), (640, 8, 32, 16, True, 3), (100, 3, 16, 6, True, 8), (37, 2, 8, 0, False, 13),
    (64, 4, 64, 64, True, MAX_TOKENS), (200, 1, 24, 8, False, 5),
]


@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", CASES)
def test_native_equals_naive_and_module(case, hidden_dtype: torch.dtype) -> None:
    hs, h, d, r, norm, t = case
    p = _module(hs, h, d, r, norm, seed=hs + t)
    stacked = p.stacked_weight()
    packed = pack_weight(stacked)
    assert packed.shape == (-(-(h * d + h + d) // 32), hs, 32)
    wide = (torch.randn(t, hs + 7) * 2).to(hidden_dtype)
    hidden = wide[:, 3: 3 + hs]  # rows strided, channels contiguous
    positions = torch.randint(0, 40000, (t,))
    assert supports_native(hidden, packed)
    args = _args(p, hidden, positions, packed)
    got = _native_or_skip(*args)
    naive = indexer_project_naive(args[0], stacked, *args[2:])
    with torch.no_grad():
        module = p(hidden, positions, None, args[5], args[6], stacked=stacked)
    for g, n, m, name in zip(got, naive, module, ("q", "k", "w")):
        assert g.dtype == torch.float32 and g.is_contiguous() and g.shape == m.shape, name
        scale = float(m.abs().max()) + 1e-6
        assert float((g - n).abs().max()) <= 2e-6 * scale * hs ** 0.5, name
        assert float((g - m).abs().max()) <= 2e-6 * scale * hs ** 0.5, name


def test_values_do_not_depend_on_threads() -> None:
    """Each output is one thread's sum: 1, 2 and 3 threads write the same bits."""
    p = _module(576, 8, 32, 16, True, seed=3)
    packed = pack_weight(p.stacked_weight())
    hidden = torch.randn(11, 576).to(torch.bfloat16)
    args = _args(p, hidden, torch.arange(11) * 700, packed)
    before = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(_native_or_skip(*args))
    finally:
        torch.set_num_threads(before)
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


def test_refuses_what_it_does_not_take() -> None:
    """``supports_native`` turns away what the kernel does not take; the kernel itself refuses a
    packed weight too small for the outputs (code 1) without writing them."""
    p = _module(48, 2, 16, 8, True, seed=5)
    packed = pack_weight(p.stacked_weight())
    assert not supports_native(torch.randn(MAX_TOKENS + 1, 48), packed)
    assert not supports_native(torch.randn(2, 48).to(torch.float16), packed)
    assert not supports_native(torch.randn(48, 2).T, packed)  # channels not contiguous
    assert not supports_native(torch.randn(2, 48), packed.to(torch.bfloat16))
    assert not supports_native(torch.randn(2, 48), packed, torch.randn(2, 16).T)
    hidden = torch.randn(2, 48)
    args = _args(p, hidden, torch.tensor([3, 9]), packed)
    _native_or_skip(*args)  # builds the library
    from kvsieve.kernels.common.native import native_library
    from kvsieve.kernels.indexer_project.native import SOURCE, _ARGTYPES

    fn = native_library(SOURCE).kvsieve_indexer_project
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    q, k, w = (torch.full((2, n), 7.0) for n in (32, 16, 2))
    _, _, nw, nb, eps, cos, sin, h, d, r, ws = args
    rc = fn(hidden.data_ptr(), 0, 48, 2, 48, packed.data_ptr(), 1, nw.data_ptr(), nb.data_ptr(), eps,
            cos.data_ptr(), sin.data_ptr(), h, d, r, ws, q.data_ptr(), k.data_ptr(), w.data_ptr(), 0, 1)
    assert rc == 1  # 1 chunk holds 32 outputs, the weight has 50
    assert all(bool((x == 7.0).all()) for x in (q, k, w))


def test_q_rounded_to_bf16_as_torch_rounds() -> None:
    """``round_q_bf16``: q is torch's ``q.to(torch.bfloat16).float()`` of the unrounded call, bit for
    bit (nearest-even), and only q is rounded; the bound call gives the function's bits."""
    p = _module(576, 8, 32, 16, True, seed=8)
    packed = pack_weight(p.stacked_weight())
    args = _args(p, torch.randn(5, 576).to(torch.bfloat16), torch.tensor([0, 7, 300, 4095, 8000]), packed)
    q, k, w = _native_or_skip(*args)
    qr, kr, wr = indexer_project_native(*args, round_q_bf16=True)
    assert torch.equal(qr, q.to(torch.bfloat16).float()) and not torch.equal(qr, q)
    assert torch.equal(kr, k) and torch.equal(wr, w)
    hidden, _, nw, nb, eps, cos, sin, h, d, r, ws = args
    call = IndexerProjectCall(packed, nw, nb, eps, h, d, r, ws)
    assert call.takes(hidden, cos, sin) and not call.takes(hidden.half(), cos, sin)
    assert not IndexerProjectCall(packed.double(), nw, nb, eps, h, d, r, ws).takes(hidden, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(call.run(hidden, cos, sin, round_q_bf16=True), (qr, kr, wr)))


def test_shapes_that_do_not_fit_are_refused_by_name() -> None:
    """A hidden size other than the packed weight's, or cos/sin or norm rows of another shape, is a
    ``ValueError`` naming the tensor (the kernel would read past them)."""
    p = _module(48, 2, 16, 8, True, seed=6)
    packed = pack_weight(p.stacked_weight())
    args = list(_args(p, torch.randn(3, 48), torch.tensor([1, 2, 3]), packed))
    _native_or_skip(*args)
    for i, bad, name in ((0, torch.randn(3, 40), "packed"), (5, torch.randn(3, 4), "cos"), (6, torch.randn(8), "sin"),
                         (2, torch.ones(8), "norm_weight"), (3, torch.ones(17), "norm_bias")):
        wrong = list(args)
        wrong[i] = bad
        with pytest.raises(ValueError, match=name):
            indexer_project_native(*wrong)


def test_the_off_switch_is_read_every_call(monkeypatch) -> None:
    """``KVSIEVE_NATIVE=0`` set after the library was loaded still turns the kernel off."""
    p = _module(48, 2, 16, 8, True, seed=7)
    args = _args(p, torch.randn(2, 48), torch.tensor([4, 5]), pack_weight(p.stacked_weight()))
    _native_or_skip(*args)
    monkeypatch.setenv("KVSIEVE_NATIVE", "0")
    with pytest.raises(NativeUnavailable):
        indexer_project_native(*args)
