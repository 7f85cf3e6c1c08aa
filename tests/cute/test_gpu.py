"""Device tests of the CuTe kernels against the references (skipped without an SM90/SM100 GPU).

Same awkward shapes as the Triton tests: page sizes 1/53/64, all-invalid rows, top-k not a
multiple of the tile, batch 1/3/17; bf16 tolerances (atol/rtol 2e-2 on out, 1e-2 on lse)."""
from __future__ import annotations

import pytest
import torch

from kvsieve.kernels.common.cute import cute_available, detect_arch


def _arch() -> str | None:
    return detect_arch("cuda") if torch.cuda.is_available() else None


needs_gpu = pytest.mark.skipif(_arch() is None or not cute_available()[0],
                               reason="needs an SM90/SM100 GPU and nvidia-cutlass-dsl")
pytestmark = [pytest.mark.sm90, pytest.mark.sm100, needs_gpu]
TOL = dict(atol=2e-2, rtol=2e-2)


def _selection(batch, page, topk, kv_len, heads=1, block=1, seed=0, all_invalid=()):
    g = torch.Generator().manual_seed(seed)
    pages = -(-kv_len // page)
    nb = batch * pages + 1
    bt = (1 + torch.randperm(nb - 1, generator=g)[: batch * pages]).view(batch, pages).int()
    lens = torch.full((batch,), kv_len, dtype=torch.int32)
    n_sel = -(-kv_len // block)
    rows = []
    for t in range(batch):
        for h in range(heads):
            sel = torch.randperm(n_sel, generator=g)[:topk].sort().values.int()
            if t in all_invalid:
                sel = torch.full_like(sel, -1)
            rows.append(sel)
    idx = torch.stack(rows).view(batch, heads, -1).transpose(0, 1).reshape(heads, -1)
    off = torch.arange(batch + 1, dtype=torch.int32) * min(topk, n_sel)
    return nb, bt, lens, idx.contiguous(), off


@pytest.mark.parametrize("page,batch,topk,heads", [(1, 1, 100, 64), (53, 3, 300, 128),
                                                   (64, 17, 2048, 128)])
@pytest.mark.parametrize("fp8", [False, True])
def test_mla_decode_matches_reference(page, batch, topk, heads, fp8):
    from kvsieve.kernels.sparse_mla_decode.cute import sparse_mla_decode
    from kvsieve.kernels.sparse_mla_decode.fp8 import quantize_fp8_mla
    from kvsieve.kernels.sparse_mla_decode.naive import sparse_mla_decode as ref
    from kvsieve.kernels.sparse_mla_decode.naive import sparse_mla_decode_fp8_reference
    nb, bt, lens, idx, off = _selection(batch, page, topk, 2500, all_invalid=(0,) if batch > 1 else ())
    g = torch.Generator().manual_seed(3)
    latent = torch.randn(nb, page, 576, generator=g).bfloat16()
    q = (torch.randn(batch, heads, 576, generator=g) * 0.3).bfloat16()
    t2r = torch.arange(batch, dtype=torch.int32)
    cache = quantize_fp8_mla(latent) if fp8 else latent
    dev = [x.cuda() for x in (q, cache, bt, t2r, lens, idx, off)]
    out, lse = sparse_mla_decode(*dev[:7], 512)
    if fp8:
        r_out, r_lse = sparse_mla_decode_fp8_reference(q, cache, bt, t2r, lens, idx, off)
    else:
        r_out, r_lse = ref(q, latent, bt, t2r, lens, idx, off, 512)
    torch.testing.assert_close(out.float().cpu(), r_out.float(), **TOL)
    inf = torch.isposinf(r_lse)
    assert torch.equal(torch.isposinf(lse.cpu()), inf)
    torch.testing.assert_close(lse.cpu()[~inf], r_lse[~inf], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("page,batch,group,block", [(1, 1, 4, 1), (53, 3, 8, 53),
                                                    (64, 17, 16, 64)])
def test_gqa_decode_matches_reference(page, batch, group, block):
    from kvsieve.kernels.sparse_gqa_decode.cute import sparse_gqa_decode
    from kvsieve.kernels.sparse_gqa_decode.naive import sparse_gqa_decode as ref
    hkv, d = 2, 128
    nb, bt, lens, idx, off = _selection(batch, page, 7 if block > 1 else 300, 1000, hkv, block,
                                        all_invalid=(1,) if batch > 1 else ())
    g = torch.Generator().manual_seed(5)
    pool = torch.randn(nb, 2, hkv, page, d, generator=g).bfloat16()
    q = torch.randn(batch, hkv * group, d, generator=g).bfloat16()
    t2r = torch.arange(batch, dtype=torch.int32)
    args = (q, pool[:, 0], pool[:, 1], bt, t2r, lens, idx, off, block)
    out, lse = sparse_gqa_decode(*[a.cuda() if torch.is_tensor(a) else a for a in args])
    r_out, r_lse = ref(*args)
    torch.testing.assert_close(out.float().cpu(), r_out.float(), **TOL)
    inf = torch.isposinf(r_lse)
    assert torch.equal(torch.isposinf(lse.cpu()), inf)
    torch.testing.assert_close(lse.cpu()[~inf], r_lse[~inf], atol=1e-2, rtol=1e-2)
