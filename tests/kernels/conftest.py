"""Shared fixtures for the Triton kernel tests: run under the Triton interpreter on CPU.

TRITON_INTERPRET must be set before ``triton.jit`` decorates the kernels (import time), so it
is set here, before any kvsieve kernel module is imported by the tests of this folder.

Tolerances (documented next to the tests that use them): fp32 kernel vs its naive reference
``1e-5`` abs + ``1e-5`` rel (same tile walk, only summation order differs); fp32 kernel vs the
independent float64 golden ``2e-5``; fp16 vs golden ``2e-3`` (fp16 inputs, fp32 accumulation).
"""
from __future__ import annotations

import math
import os

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402

F32_TOL = dict(atol=1e-5, rtol=1e-5)
GOLDEN_TOL = dict(atol=2e-5, rtol=2e-5)
F16_TOL = dict(atol=2e-3, rtol=2e-3)


def make_cache(num_blocks: int, hkv: int, page: int, d: int, dv: int | None = None,
               layout: str = "HND", dtype: torch.dtype = torch.float32,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V 4-D views ``[num_blocks, hkv, page, d]`` of an HND or NHD pool (strided)."""
    g = torch.Generator().manual_seed(seed)
    dv = dv or d
    if dv != d:
        k = torch.randn(num_blocks, page, hkv, d, generator=g).to(dtype).transpose(1, 2)
        v = torch.randn(num_blocks, hkv, page, dv, generator=g).to(dtype)
        return k, v
    if layout == "HND":
        pool = torch.randn(num_blocks, 2, hkv, page, d, generator=g).to(dtype)
        return pool[:, 0], pool[:, 1]
    pool = torch.randn(num_blocks, 2, page, hkv, d, generator=g).to(dtype)
    return pool[:, 0].transpose(1, 2), pool[:, 1].transpose(1, 2)


def make_block_table(batch: int, max_len: int, page: int, num_blocks: int,
                     seed: int = 0) -> torch.Tensor:
    """Distinct random physical blocks (never the sentinel 0) + one padded 0 column."""
    g = torch.Generator().manual_seed(seed)
    width = -(-max_len // page) + 1
    perm = torch.randperm(num_blocks - 1, generator=g)[: batch * width] + 1
    bt = perm.reshape(batch, width).to(torch.int32)
    bt[:, -1] = 0
    return bt


def make_selection(kv_lens: list[int], hkv: int, block_size: int, n_sel: int, seed: int = 0,
                   n_pad: int = 1, n_beyond: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and head: ascending unique valid entries, then entries beyond kv_len, then -1."""
    g = torch.Generator().manual_seed(seed)
    rows = [[] for _ in range(hkv)]
    offsets = [0]
    for kv_len in kv_lens:
        n_valid_max = -(-kv_len // block_size)
        k = min(n_sel, n_valid_max)
        for h in range(hkv):
            sel = torch.sort(torch.randperm(n_valid_max, generator=g)[:k]).values.tolist()
            beyond = [n_valid_max + i for i in range(n_beyond)]
            rows[h] += sel + beyond + [-1] * n_pad
        offsets.append(offsets[-1] + k + n_beyond + n_pad)
    return (torch.tensor(rows, dtype=torch.int32).reshape(hkv, -1),
            torch.tensor(offsets, dtype=torch.int32))


def golden_positions(indices: torch.Tensor | None, offsets: torch.Tensor | None, t: int,
                     h: int, kv_len: int, block_size: int) -> list[int]:
    """Positions token t / kv head h attends, by the contract, written independently."""
    if indices is None:
        return list(range(kv_len))
    out = []
    for e in indices[h, int(offsets[t]):int(offsets[t + 1])].tolist():
        if e >= 0:
            out += [p for p in range(e * block_size, (e + 1) * block_size) if p < kv_len]
    return out


def golden_attention(q: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, block_table,
                     token_to_req, kv_lens, indices, offsets, block_size: int,
                     sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Direct float64 attention: gather per token with plain indexing, masked softmax."""
    num_tokens, hq, _ = q.shape
    hkv, page = k4.shape[1], k4.shape[2]
    group = hq // hkv
    out = torch.zeros(num_tokens, hq, v4.shape[3], dtype=torch.float64)
    lse = torch.full((num_tokens, hq), math.inf, dtype=torch.float64)
    for t in range(num_tokens):
        req = int(token_to_req[t])
        for h in range(hkv):
            pos = golden_positions(indices, offsets, t, h, int(kv_lens[t]), block_size)
            if not pos:
                continue
            phys = [int(block_table[req, p // page]) for p in pos]
            k = torch.stack([k4[b, h, p % page] for b, p in zip(phys, pos)]).double()
            v = torch.stack([v4[b, h, p % page] for b, p in zip(phys, pos)]).double()
            qs = q[t, h * group:(h + 1) * group].double()
            s = qs @ k.T * sm_scale
            lse[t, h * group:(h + 1) * group] = torch.logsumexp(s, -1)
            out[t, h * group:(h + 1) * group] = torch.softmax(s, -1) @ v
    return out, lse


def assert_close_lse(a: torch.Tensor, b: torch.Tensor, **tol) -> None:
    """Compare LSEs, requiring +inf in exactly the same places."""
    a64, b64 = a.double(), b.double()
    assert torch.equal(torch.isinf(a64), torch.isinf(b64))
    fin = ~torch.isinf(a64)
    torch.testing.assert_close(a64[fin], b64[fin], **tol)
