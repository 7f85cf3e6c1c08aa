"""The torch backend's one-token path (a phase or chunk of a single query row: the decode step of
one request) against the Vanilla golden: out, LSE and attended counts, on dense rows, padded and
overshooting selections, repeated units, empty rows, every block size against the page — through
the native kernel (``kvsieve.kernels.sparse_gqa_decode.native``) and, with ``KVSIEVE_NATIVE=0``, through
PyTorch's flash kernel."""
from __future__ import annotations

import shutil

import pytest
import torch

from kvsieve import SparseRuntimeParams
from kvsieve.sparse.backends import get_backend
from kvsieve.sparse.backends.torch_backend import TorchBackend

from .harness import build, random_selection

HAS_CC = shutil.which("cc") is not None or shutil.which("gcc") is not None


@pytest.fixture(params=["native", "torch"])
def engine(request, monkeypatch):
    """The one-token path's engine: the C kernel (where a compiler is), or PyTorch's flash kernel."""
    if request.param == "native" and not HAS_CC:
        pytest.skip("no C compiler on this machine: the native kernel cannot build")
    if request.param == "torch":
        monkeypatch.setenv("KVSIEVE_NATIVE", "0")
    return request.param


def _check(backend, md, q, geo, params):
    res = backend.forward(q, md, 0, geo, params)
    ref = get_backend("vanilla").forward(q, md, 0, geo, params)
    torch.testing.assert_close(res.out, ref.out, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isposinf(res.lse), torch.isposinf(ref.lse)), "empty rows give lse +inf"
    finite = torch.isfinite(ref.lse)
    torch.testing.assert_close(res.lse[finite], ref.lse[finite], rtol=1e-5, atol=1e-5)
    assert torch.equal(res.attended, ref.attended)
    return res


def _repeated(params: SparseRuntimeParams) -> SparseRuntimeParams:
    """Every non-empty segment lists its first unit twice (possible only with validation off)."""
    idx, off = params.sparse_attn_indices, params.sparse_attn_offsets.tolist()
    segs, new_off = [], [0]
    for t in range(len(off) - 1):
        seg = idx[:, off[t]: off[t + 1]]
        seg = torch.cat([seg[:, :1], seg], 1) if seg.shape[1] else seg
        segs.append(seg)
        new_off.append(new_off[-1] + seg.shape[1])
    return SparseRuntimeParams(sparse_attn_indices=torch.cat(segs, 1), sparse_attn_offsets=torch.tensor(
        new_off, dtype=torch.int32), sparse_attn_indices_block_size=params.sparse_attn_indices_block_size)


@pytest.mark.parametrize("block_size,page", [(1, 16), (4, 16), (16, 16), (64, 16), (16, 53), (8, 1)])
@pytest.mark.parametrize("group", [1, 3])
def test_one_decode_request(block_size, page, group, engine):
    md, q, geo = build(page=page, hq=2 * group, hkv=2, d=16, ctx_lens=[], gen_hist=[150], seed=block_size)
    backend = TorchBackend()
    suffix = "_native" if engine == "native" else ""
    assert _check(backend, md, q, geo, None).paths == {"generation": "dense_runs" + suffix}
    sel = random_selection(md, 2, k=5, block_size=block_size, overshoot=2, seed=page)
    assert _check(backend, md, q, geo, sel).paths == {"generation": "sparse_runs" + suffix}
    _check(backend, md, q, geo, _repeated(sel))
    empty = random_selection(md, 2, k=3, block_size=block_size, pad_frac=1.0)
    res = _check(backend, md, q, geo, empty)
    assert torch.count_nonzero(res.out) == 0 and int(res.attended.sum()) == 0


@pytest.mark.parametrize("block_size", [1, 16])
def test_chunks_of_one_token_in_a_mixed_batch(block_size, engine):
    """``max_gather_bytes=1`` makes every chunk one token: prefill rows and decode rows of several
    requests all take the one-token path and still equal the golden."""
    md, q, geo = build(page=16, hq=4, hkv=2, d=16, ctx_lens=[9, 30], gen_hist=[40, 3, 77], seed=7)
    backend = TorchBackend(max_gather_bytes=1)
    _check(backend, md, q, geo, None)
    sel = random_selection(md, 2, k=4, block_size=block_size, overshoot=1, seed=3)
    _check(backend, md, q, geo, sel)
    _check(backend, md, q, geo, _repeated(sel))


@pytest.mark.parametrize("rows,masked", [
    ([[0, 3, 9], [1, 5, 9]], False),    # sorted, unique, the newest (partial) page last in both heads
    ([[9, 3, 0], [5, 9, 1]], False),    # any order: the backend sorts
    ([[0, 3, 9], [1, 5, 7]], True),     # head 1 reads a full page where head 0 reads the partial one
    ([[-1, 3, 9], [1, 5, 9]], True),    # padding: head 0 reads one page fewer
    ([[3, 3, 9], [1, 5, 9]], True),     # a repeated page is read once
    ([[0, 3, 11], [1, 5, 12]], False),  # pages past the context sort last: not read, no mask needed
    ([[0, 9, 11], [1, 5, 12]], True),   # ... but a partial page in one head only needs it
])
def test_unmasked_prefix_only_when_every_head_reads_a_same_length_prefix(monkeypatch, rows, masked):
    """The one-token path skips the mask only when each head's valid positions are the first
    ``width`` of its gathered runs (the same for every head); otherwise the mask holds them
    apart. Both against the golden, with the kernel call observed."""
    from kvsieve.sparse.backends.torch_backend import token as torch_token

    monkeypatch.setenv("KVSIEVE_NATIVE", "0")  # the PyTorch flash path's mask choice
    md, q, geo = build(page=16, hq=4, hkv=2, d=16, ctx_lens=[], gen_hist=[150], seed=2)  # kv_len 151: page 9 partial
    biases = []
    flash = torch_token.flash_cpu

    def spy(q_, k_, v_, bias, scale):
        biases.append(bias)
        return flash(q_, k_, v_, bias, scale)

    monkeypatch.setattr(torch_token, "flash_cpu", spy)
    sel = SparseRuntimeParams(sparse_attn_indices=torch.tensor(rows, dtype=torch.int32),
                              sparse_attn_offsets=torch.tensor([0, 3], dtype=torch.int32),
                              sparse_attn_indices_block_size=16)
    _check(TorchBackend(), md, q, geo, sel)
    assert len(biases) == 1 and (biases[0] is not None) == masked
