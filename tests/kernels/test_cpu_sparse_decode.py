"""The native CPU one-token attention (``kvsieve.kernels.sparse_gqa_decode.native``) against its naive twin
and an independent float64 softmax over the listed tokens."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from kvsieve.kernels.common.native import NativeUnavailable
from kvsieve.kernels.sparse_gqa_decode.naive import sparse_decode_naive
from kvsieve.kernels.sparse_gqa_decode.native import sparse_decode_native, supports_native

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler on this machine: the native kernel cannot build")


def _case(hkv, g, d, unit, n_runs, dtype, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    n_rows = 4 * hkv * n_runs + 8
    rows = (torch.from_numpy(rng.standard_normal((n_rows, unit * d), dtype=np.float32)) * scale).to(dtype)
    k_rows = rng.integers(0, n_rows // 2, size=(hkv, n_runs)).astype(np.int64)
    cnt = rng.integers(0, unit + 1, size=(hkv, n_runs)).astype(np.int32)
    q = torch.from_numpy(rng.standard_normal((hkv * g, d), dtype=np.float32))
    return rows, k_rows, cnt, n_rows // 2, q


def _float64_reference(rows, k_rows, cnt, v_offset, q, sm_scale):
    hkv, n_runs = k_rows.shape
    d = q.shape[1]
    out, lse = torch.zeros(q.shape[0], d, dtype=torch.float64), torch.full((q.shape[0],), torch.inf, dtype=torch.float64)
    g = q.shape[0] // hkv
    for h in range(hkv):
        keys = [rows[k_rows[h, u]].double().view(-1, d)[t] for u in range(n_runs) for t in range(cnt[h, u])]
        vals = [rows[k_rows[h, u] + v_offset].double().view(-1, d)[t] for u in range(n_runs) for t in range(cnt[h, u])]
        if not keys:
            continue
        s = q[h * g:(h + 1) * g].double() @ torch.stack(keys).T * sm_scale
        lse[h * g:(h + 1) * g] = torch.logsumexp(s, -1)
        out[h * g:(h + 1) * g] = torch.softmax(s, -1) @ torch.stack(vals)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hkv,g,d,unit,n_runs", [(3, 3, 64, 16, 40), (2, 4, 128, 8, 30), (1, 7, 80, 1, 150),
                                                 (2, 16, 64, 64, 5), (4, 1, 256, 16, 9)])
def test_native_matches_naive_and_float64(dtype, hkv, g, d, unit, n_runs):
    rows, k_rows, cnt, v_off, q = _case(hkv, g, d, unit, n_runs, dtype, seed=d + unit)
    cnt[-1, :] = 0  # a head that reads nothing: out 0, lse +inf
    assert supports_native(rows, q, hkv)
    out, lse = sparse_decode_native(rows, k_rows, cnt, v_off, q, sm_scale=d ** -0.5)
    n_out, n_lse = sparse_decode_naive(rows, torch.from_numpy(k_rows), torch.from_numpy(cnt), v_off, q, sm_scale=d ** -0.5)
    r_out, r_lse = _float64_reference(rows, k_rows, cnt, v_off, q, d ** -0.5)
    torch.testing.assert_close(out, n_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), r_out, atol=2e-5, rtol=2e-5)
    assert torch.equal(torch.isposinf(lse), torch.isposinf(r_lse)) and bool(torch.isposinf(lse[-g:]).all())
    finite = torch.isfinite(r_lse)
    torch.testing.assert_close(lse[finite].double(), r_lse[finite], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse[finite], n_lse[finite], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[-g:], torch.zeros(g, d))


def test_running_max_rescales_across_chunks():
    """Scores that grow run after run (the running max moves in every 64-token chunk) and spread
    over hundreds of nats: the online softmax still equals the float64 one."""
    rows, k_rows, cnt, v_off, q = _case(2, 3, 64, 16, 40, torch.float32, seed=5)
    cnt[:] = 16
    k_rows[:] = np.arange(40)[None, :]  # both heads read the same rows, in order
    ramp = torch.linspace(0.0, 30.0, 40 * 16).view(40, 16, 1)
    rows[:40] = (rows[:40].view(40, 16, 64) * 0.1 + ramp * q[0].sign() / 8).view(40, -1)
    out, lse = sparse_decode_native(rows, k_rows, cnt, v_off, q, sm_scale=1.0)
    r_out, r_lse = _float64_reference(rows, k_rows, cnt, v_off, q, 1.0)
    assert float(r_lse.max() - r_lse.min()) > 50.0
    torch.testing.assert_close(out.double(), r_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), r_lse, atol=2e-5, rtol=2e-5)


def test_unavailable_library_is_reported(monkeypatch):
    rows, k_rows, cnt, v_off, q = _case(1, 2, 64, 16, 3, torch.float32, seed=1)
    monkeypatch.setenv("KVSIEVE_NATIVE", "0")
    with pytest.raises(NativeUnavailable, match="KVSIEVE_NATIVE=0"):
        sparse_decode_native(rows, k_rows, cnt, v_off, q, sm_scale=0.125)
    assert not supports_native(rows.to(torch.float16), q, 1)  # fp16 pools: the PyTorch path
