"""Every Triton kernel against its plain-PyTorch reference on awkward shapes.

One case = one kernel call and its ``naive`` reference on the same inputs; the result is a
:class:`CaseResult` (max error ``|got - ref| / (1 + |ref|)``, tolerance, pass). Shapes are chosen to hit the edges: page
sizes that do not divide the context (53) or are tiny (1), GQA groups that are not powers of two
(7), head dims split into a power of two and a remainder (96 = 64 + 32, 576 = 512 + 64),
selections with ``-1`` and beyond-context entries, block-granular selections, top-k widths not a
multiple of the tile, empty rows, forced split-K, skip-softmax with its tile counters.

On a GPU the cases run in bf16 (fp32 for top-k and indexer scores) with the compiled kernels;
on CPU (``--device cpu``, the dry run) they run in fp32 under ``TRITON_INTERPRET=1`` with the
same code, which is what lets the driver be tested without a GPU. ``small=True`` keeps one small
case per kernel (for ``compute-sanitizer``, which slows every launch down).

``python -m kvsieve.gpu_check.cases [--device cuda] [--small] [--json PATH] [--perturb EPS]``
prints one line per case and exits 1 on any mismatch. ``--perturb EPS`` scales every reference
output by ``1 + EPS`` before comparing: a self-test that the comparison catches an error of that
size (the driver's tests use it on CPU; it is never set in a real check).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

__all__ = ["CaseResult", "CASES", "rel_err", "run_cases", "main"]

# bf16 on a device against the fp32-accumulating reference; fp32 under the interpreter
TOL = {torch.bfloat16: 3e-2, torch.float16: 3e-3, torch.float32: 1e-4}


@dataclass(frozen=True)
class CaseResult:
    """One kernel-vs-reference comparison."""

    name: str
    kernel: str
    shape: str
    dtype: str
    max_err: float
    tol: float
    passed: bool
    seconds: float
    detail: str = ""


@dataclass(frozen=True)
class Env:
    device: torch.device
    dtype: torch.dtype  # attention inputs
    perturb: float
    seed: int = 0

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed + sum(shape))
        return (torch.randn(*shape, generator=g) * scale).to(self.device, self.dtype)

    def ints(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.device)


def _paged(env: Env, kv_lens: list[int], hkv: int, page: int, d: int, dv: int):
    """Shuffled block table (sentinel block 0 never used), K as an NHD pool view, V as HND."""
    width = -(-max(kv_lens) // page)
    g = torch.Generator().manual_seed(env.seed + page)
    nb = len(kv_lens) * width + 1
    bt = (torch.randperm(nb - 1, generator=g) + 1).to(torch.int32).view(len(kv_lens), width)
    k = env.randn(nb, page, hkv, d).transpose(1, 2)
    v = env.randn(nb, hkv, page, dv)
    return bt.to(env.device), k, v


def _selection(env: Env, kv_lens: list[int], hkv: int, n_sel: int, block_size: int = 1):
    """Per token/head: ascending random entries, one beyond the context, one -1."""
    g = torch.Generator().manual_seed(env.seed + n_sel)
    rows: list[list[int]] = [[] for _ in range(hkv)]
    offsets = [0]
    for kv_len in kv_lens:
        n_blocks = -(-kv_len // block_size)
        k = min(n_sel, n_blocks)
        for h in range(hkv):
            rows[h] += sorted(torch.randperm(n_blocks, generator=g)[:k].tolist()) + [n_blocks + 2, -1]
        offsets.append(offsets[-1] + k + 2)
    return env.ints(rows), env.ints(offsets)


def rel_err(got: torch.Tensor, want: torch.Tensor, perturb: float = 0.0) -> float:
    """``max |got - want| / (1 + |want|)`` over finite entries (absolute below 1, relative above:
    one bf16 rounding step of a value near 4 is 0.016); inf positions must agree exactly, NaN never
    passes (both give inf)."""
    got, want = got.double().cpu(), want.double().cpu() * (1.0 + perturb)
    if not torch.equal(torch.isinf(got), torch.isinf(want)) or bool(torch.isnan(got).any()):
        return math.inf
    fin = ~torch.isinf(want)
    return float(((got[fin] - want[fin]).abs() / (1 + want[fin].abs())).max()) if bool(fin.any()) else 0.0


def _attention(env: Env, fn, ref, args: tuple, kwargs: dict) -> tuple[float, str]:
    o, lse = fn(*args, **kwargs)
    ro, rlse = ref(*args, **kwargs)
    return max(rel_err(o, ro, env.perturb), rel_err(lse, rlse, env.perturb)), ""


def gqa_decode(env: Env, small: bool) -> tuple[str, float, str]:
    from ..kernels.sparse_gqa_decode import naive, triton as kernel
    kv, hkv, group, page, d = ([1, 77], 2, 7, 53, 96) if small else ([1, 333, 1000], 2, 7, 53, 96)
    bt, k, v = _paged(env, kv, hkv, page, d, d)
    q = env.randn(len(kv), hkv * group, d)
    tok, kl = env.ints(list(range(len(kv)))), env.ints(kv)
    idx, off = _selection(env, kv, hkv, 40)
    err, _ = _attention(env, kernel.sparse_gqa_decode, naive.sparse_gqa_decode,
                        (q, k, v, bt, tok, kl, idx, off), {"num_splits": 3})
    return f"kv={kv} Hkv={hkv} group={group} page={page} D={d} splits=3", err, ""


def gqa_decode_blocks(env: Env, small: bool) -> tuple[str, float, str]:
    from ..kernels.sparse_gqa_decode import naive, triton as kernel
    kv, hkv, group, page, d, bs = [5, 300], 1, 4, 1, 128, 16
    if small:
        kv = [5, 40]
    bt, k, v = _paged(env, kv, hkv, page, d, d)
    q = env.randn(len(kv), hkv * group, d)
    idx, off = _selection(env, kv, hkv, 6, bs)
    err, _ = _attention(env, kernel.sparse_gqa_decode, naive.sparse_gqa_decode,
                        (q, k, v, bt, env.ints([0, 1]), env.ints(kv), idx, off), {"block_size": bs})
    return f"kv={kv} page={page} block_size={bs} D={d}", err, ""


def gqa_skip_softmax(env: Env, small: bool) -> tuple[str, float, str]:
    from ..kernels.sparse_gqa_decode import naive, triton as kernel
    kv, hkv, group, page, d = ([700], 2, 4, 16, 64) if small else ([256, 700], 2, 4, 16, 64)
    bt, k, v = _paged(env, kv, hkv, page, d, d)
    q = env.randn(len(kv), hkv * group, d).float()
    q = (q / q.norm(dim=-1, keepdim=True) * 8).to(env.dtype)
    k.mul_(0.1)
    for t in range(len(kv)):  # the first 64 keys align with the query: later tiles fall under the threshold
        for p in range(64):
            k[bt[t, p // page], :, p % page] += q[t].reshape(hkv, group, d).mean(1) * 3.0
    args = (q, k, v, bt, env.ints(list(range(len(kv)))), env.ints(kv))
    got_st = torch.zeros(2, dtype=torch.int64, device=env.device)
    want_st = torch.zeros(2, dtype=torch.int64, device=env.device)
    o, lse = kernel.sparse_gqa_decode(*args, threshold_scale_factor=2.0, stats=got_st)
    ro, rlse = naive.sparse_gqa_decode(*args, threshold_scale_factor=2.0, stats=want_st)
    err = max(rel_err(o, ro, env.perturb), rel_err(lse, rlse, env.perturb))
    # the tile counters are integers: any difference is a mismatch, and the case must skip something
    if not torch.equal(got_st.cpu(), want_st.cpu()) or int(want_st[0]) == 0:
        err = math.inf
    return f"kv={kv} factor=2.0", err, f"skipped/walked kernel {got_st.tolist()} reference {want_st.tolist()}"


def prefill(env: Env, small: bool) -> tuple[str, float, str]:
    from ..kernels.paged_prefill import naive, triton as kernel
    hkv, group, page, d = 2, 3, 16, 64
    n = 20 if small else 70
    kv = [30, 30 + n]
    bt, k, v = _paged(env, kv, hkv, page, d, d)
    tok = env.ints([1] * n)
    kl = env.ints([kv[0] + 1 + i for i in range(n)])
    q = env.randn(n, hkv * group, d)
    err, _ = _attention(env, kernel.paged_prefill, naive.paged_prefill, (q, k, v, bt, tok, kl), {})
    return f"dense_tiled {n} tokens Hkv={hkv} group={group} page={page}", err, ""


def prefill_sparse(env: Env, small: bool) -> tuple[str, float, str]:
    from ..kernels.paged_prefill import naive, triton as kernel
    hkv, group, page, d = 1, 5, 8, 64
    kv = [9, 10, 11] if small else [9, 10, 11, 200]
    bt, k, v = _paged(env, kv, hkv, page, d, d)
    q = env.randn(len(kv), hkv * group, d)
    idx, off = _selection(env, kv, hkv, 7)
    err, _ = _attention(env, kernel.paged_prefill, naive.paged_prefill,
                        (q, k, v, bt, env.ints(list(range(len(kv)))), env.ints(kv), idx, off), {})
    return f"sparse_gather kv={kv} group={group}", err, ""


def mla_decode(env: Env, small: bool) -> tuple[str, float, str]:
    from ..kernels.sparse_mla_decode import naive, triton as kernel
    heads = 16 if small else 128
    kv, page = [1, 300], 64
    bt, lat, _ = _paged(env, kv, 1, page, 576, 1)
    lat = lat[:, 0].contiguous()
    q = env.randn(len(kv), heads, 576, scale=0.3)
    idx, off = _selection(env, kv, 1, 100)
    err, _ = _attention(env, kernel.sparse_mla_decode, naive.sparse_mla_decode,
                        (q, lat, bt, env.ints([0, 1]), env.ints(kv), idx, off, 512, 0.07), {})
    return f"kv={kv} heads={heads} 512+64 topk=100", err, ""


def merge(env: Env, small: bool) -> tuple[str, float, str]:
    from ..kernels.common.merge_states import naive, triton as kernel
    t, h, s, d = (3, 2, 5, 40) if small else (17, 8, 33, 128)
    v = env.randn(t, h, s, d)
    lse = torch.randn(t, h, s, generator=torch.Generator().manual_seed(1)).to(env.device)
    lse[0, 0, :] = math.inf  # an empty (token, head): every state empty
    lse[1, :, ::2] = -math.inf
    o, l = kernel.merge_states(v, lse)
    ro, rl = naive.merge_states(v, lse)
    return f"[{t},{h},{s},{d}] with empty states", max(rel_err(o, ro, env.perturb), rel_err(l, rl, env.perturb)), ""


def compact(env: Env, small: bool) -> tuple[str, float, str]:
    from ..kernels.compact_kv import naive, triton as kernel
    hkv, page, d, n = 2, 16, 64, 100 if not small else 40
    bt, k, v = _paged(env, [n], hkv, page, d, d)
    g = torch.Generator().manual_seed(3)
    keep = torch.stack([torch.randperm(n, generator=g)[: n // 3].sort().values for _ in range(hkv)])
    keep = keep.to(torch.int32).to(env.device)
    k2, v2 = k.clone(), v.clone()
    kernel.compact_kv_(k, v, bt[0], keep)
    naive.compact_kv_(k2, v2, bt[0], keep)
    return f"Hkv={hkv} page={page} keep {n // 3} of {n}", max(rel_err(k, k2, env.perturb), rel_err(v, v2, env.perturb)), ""


def _topk_rows(n: int, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    s = torch.randn(rows, n, generator=g)
    s[1 % rows] = torch.randint(0, 5, (n,), generator=g).float()  # heavy ties
    lens = torch.full((rows,), n, dtype=torch.int32)
    lens[-1] = max(1, n // 3)
    return s.to(device), lens.to(device)


def topk(env: Env, small: bool) -> tuple[str, float, str]:
    from ..kernels.topk import naive, plan
    widths, k = ((700,), 128) if small else ((1, 2049, 9295), 512)
    bad = []
    for width in widths:
        scores, lens = _topk_rows(width, 3, env.device)
        want = naive.radix_topk(scores.cpu(), lens.cpu(), k)
        for engine in ("radix", "gvr"):
            d = plan.choose_topk_engine(engine, device=env.device, index_topk=k)
            got = plan.run_topk(plan.TopKWorkspace(d, 3, env.device), scores, lens).cpu()
            if env.perturb or not torch.equal(got, want):  # positions are exact integers
                bad.append(f"{engine} width {width}")
    return f"widths={list(widths)} k={k} radix+gvr", (math.inf if bad else 0.0), "; ".join(bad)


def indexer(env: Env, small: bool) -> tuple[str, float, str]:
    from ..kernels.dsa_indexer import naive, triton as kernel
    t, h, d, page = (2, 4, 64, 16) if small else (3, 16, 128, 64)
    kv = [5, 130] if small else [5, 130, 1000]
    bt, kc, _ = _paged(env, kv, 1, page, d, 1)
    kc = kc[:, 0].contiguous()
    q = env.randn(len(kv), h, d)
    w = torch.rand(len(kv), h, generator=torch.Generator().manual_seed(2)).to(env.device) * d ** -0.5
    tok, kl = env.ints(list(range(len(kv)))), env.ints(kv)
    width = max(kv) + 7
    got = kernel.indexer_logits_decode(q, kc, None, w, bt, tok, kl, width)
    want = naive.indexer_logits_decode(q, kc, None, w, bt, tok, kl, width)
    return f"decode kv={kv} H={h} D={d} page={page}", rel_err(got, want, env.perturb), ""


CASES: dict[str, tuple[str, Callable]] = {
    "gqa_decode": ("sparse_gqa_decode", gqa_decode),
    "gqa_decode_blocks": ("sparse_gqa_decode", gqa_decode_blocks),
    "gqa_skip_softmax": ("sparse_gqa_decode", gqa_skip_softmax),
    "prefill_dense": ("paged_prefill", prefill),
    "prefill_sparse": ("paged_prefill", prefill_sparse),
    "mla_decode": ("sparse_mla_decode", mla_decode),
    "merge_states": ("merge_states", merge),
    "compact_kv": ("compact_kv_", compact),
    "topk": ("radix/gvr top-k", topk),
    "indexer_decode": ("indexer_logits_decode", indexer),
}
SMALL = ("gqa_decode", "gqa_skip_softmax", "prefill_dense", "mla_decode", "merge_states", "compact_kv", "topk", "indexer_decode")


def run_cases(device: str, small: bool = False, perturb: float = 0.0,
              names: tuple[str, ...] | None = None) -> list[CaseResult]:
    """Run the cases (``SMALL`` ones when ``small``) on ``device``; exceptions are failures."""
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    env = Env(dev, dtype, perturb)
    out = []
    for name in names or (SMALL if small else tuple(CASES)):
        kernel_name, fn = CASES[name]
        t0 = time.perf_counter()
        try:
            shape, err, detail = fn(env, small)
        except Exception as e:  # a crash in a kernel is a result to report, not a driver crash
            shape, err, detail = "", math.inf, f"{type(e).__name__}: {e}"[:500]
        tol = TOL[dtype]
        out.append(CaseResult(name, kernel_name, shape, str(dtype).replace("torch.", ""),
                              err, tol, err <= tol, round(time.perf_counter() - t0, 3), detail))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvsieve.gpu_check.cases", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="one small case per kernel")
    ap.add_argument("--perturb", type=float, default=0.0, help="self-test: scale references by 1+EPS")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    if torch.device(a.device).type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("--device cpu needs TRITON_INTERPRET=1 in the environment (set before Triton is imported)")
        return 2
    results = run_cases(a.device, a.small, a.perturb)
    for r in results:
        print(f"{'ok  ' if r.passed else 'FAIL'} {r.name:<18} {r.kernel:<22} {r.dtype:<8} err {r.max_err:.3g} "
              f"(tol {r.tol:g}) {r.seconds:.1f}s  {r.shape} {r.detail}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
