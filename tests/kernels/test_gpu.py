"""Device tests (bf16 on the real kernels vs the references); skipped without the GPU."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_close_lse, make_block_table, make_selection

BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def _cap() -> int:
    if not torch.cuda.is_available():
        return -1
    return torch.cuda.get_device_capability()[0]


def _run_all():
    # The session runs under TRITON_INTERPRET=1; a device test needs compiled kernels, so it
    # runs in a subprocess without the interpreter.
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)), timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def _device_checks() -> None:
    from kvsieve.kernels.paged_prefill import naive as pn
    from kvsieve.kernels.paged_prefill.triton import paged_prefill
    from kvsieve.kernels.sparse_gqa_decode import naive as gn
    from kvsieve.kernels.sparse_gqa_decode.triton import sparse_gqa_decode
    from kvsieve.kernels.sparse_mla_decode import naive as mn
    from kvsieve.kernels.sparse_mla_decode.triton import sparse_mla_decode

    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    kv = [1000, 333, 2048]
    bt = make_block_table(3, 2048, 64, 3 * 34 + 2).to(dev)
    pool = torch.randn(int(bt.max()) + 1, 2, 64, 8, 128, device=dev, dtype=dt)
    k, v = pool[:, 0].transpose(1, 2), pool[:, 1].transpose(1, 2)
    q = torch.randn(3, 64, 128, device=dev, dtype=dt)
    tok = torch.arange(3, dtype=torch.int32, device=dev)
    kl = torch.tensor(kv, dtype=torch.int32, device=dev)
    idx, off = (x.to(dev) for x in make_selection(kv, 8, 1, 256))
    for fn, ref in ((sparse_gqa_decode, gn.sparse_gqa_decode), (paged_prefill, pn.paged_prefill)):
        o, l = fn(q, k, v, bt, tok, kl, idx, off)
        ro, rl = ref(q, k, v, bt, tok, kl, idx, off)
        torch.testing.assert_close(o.float(), ro.float(), **BF16_TOL)
        assert_close_lse(l, rl, **BF16_TOL)
    o, l = sparse_gqa_decode(q, k, v, bt, tok, kl)
    ro, rl = gn.sparse_gqa_decode(q, k, v, bt, tok, kl)
    torch.testing.assert_close(o.float(), ro.float(), **BF16_TOL)
    tok_p = torch.zeros(64, dtype=torch.int32, device=dev)
    kl_p = torch.arange(1, 65, dtype=torch.int32, device=dev) + 900
    qp = torch.randn(64, 64, 128, device=dev, dtype=dt)
    o, l = paged_prefill(qp, k, v, bt, tok_p, kl_p)
    ro, rl = pn.paged_prefill(qp, k, v, bt, tok_p, kl_p)
    torch.testing.assert_close(o.float(), ro.float(), **BF16_TOL)
    lat = torch.randn(int(bt.max()) + 1, 64, 576, device=dev, dtype=dt)
    qm = torch.randn(3, 128, 576, device=dev, dtype=dt) * 0.3
    midx, moff = (x.to(dev) for x in make_selection(kv, 1, 1, 256))
    o, l = sparse_mla_decode(qm, lat, bt, tok, kl, midx, moff, 512, 0.07)
    ro, rl = mn.sparse_mla_decode(qm, lat, bt, tok, kl, midx, moff, 512, 0.07)
    torch.testing.assert_close(o.float(), ro.float(), **BF16_TOL)
    assert_close_lse(l, rl, **BF16_TOL)


@pytest.mark.sm90
@pytest.mark.skipif(_cap() != 9, reason="needs an SM90 GPU")
def test_sm90_device():
    _run_all()


@pytest.mark.sm100
@pytest.mark.skipif(_cap() != 10, reason="needs an SM100 GPU")
def test_sm100_device():
    _run_all()


if __name__ == "__main__":
    import os
    os.environ.pop("TRITON_INTERPRET", None)  # conftest sets it for the CPU session
    _device_checks()
