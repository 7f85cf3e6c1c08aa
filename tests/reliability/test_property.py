"""Cross-backend property test: seeded random batches (mixed phases, chunked prefill, multi-token
decode, page sizes 3/7/33/96, head dims 40/80/96/192, group sizes 1/5/7, MLA 256+32), every
selector on every CPU-runnable backend (vanilla, torch, triton under the interpreter) gives the
Vanilla golden's output, and each layer's stats equal the positions the backend really reads
(counted here from the selection mask: exact tokens for vanilla/torch, whole touched pages for
triton, which gathers pages).

The cases are a fixed-seed sample of the product (each selector and each shape value appears),
not the whole product, to keep the file well under a minute.
"""
from __future__ import annotations

import random

import pytest
import torch

from kvsieve import Engine, KVCacheManager, KVCacheSpec, SparseAttention, lower_config
from kvsieve.selectors.dsa.projections import IndexerInputs
from kvsieve.sparse import SparseAttentionConfig, selection_mask

BACKENDS = ("vanilla", "torch", "triton")
PAGES = (3, 7, 33, 96)
HEAD_DIMS = (40, 80, 96, 192)
GROUPS = (1, 5, 7)


def selector_params(name: str, page: int) -> dict:
    """Small settings that sparsify the short random contexts; page knobs that divide ``page``."""
    sub = 32 if page == 96 else 1  # a power of two dividing the cache page
    return {
        None: {}, "streaming": {"budget": 9, "num_sink": 2}, "oracle_topk": {"budget": 8},
        "oracle_topk_blocks": {"budget": 8, "block_size": 4},
        "quest": {"budget": max(2 * sub, 6), "page_size": sub if sub > 1 else 2 if page % 2 == 0 else 1,
                  "summary_dtype": "float32"},
        "rocketkv": {"window_size": 3, "kernel_size": 3, "prompt_budget": 10, "page_size": sub,
                     "topk": 4 if sub == 1 else 1, "summary_dtype": "float32"},
        "snapkv": {"window_size": 3, "kernel_size": 3, "prompt_budget": 8},
        "block_select": {"block_size": 4, "topk_blocks": 3},
        "dsa": {"index_topk": 7, "n_heads": 2, "head_dim": 8, "rope_dim": 4, "index_k_dtype": "float32",
                "topk_engine": "torch"},
    }[name]


# skip_softmax is left out here: its backends agree tile for tile in tests/skip_softmax/test_cpu_backends.py
GQA_SELECTORS = [None, "streaming", "oracle_topk", "oracle_topk_blocks", "quest", "rocketkv", "snapkv",
                 "block_select", "dsa"]
MLA_SELECTORS = [None, "streaming", "oracle_topk", "oracle_topk_blocks", "dsa"]
EVICTING = {"rocketkv", "snapkv"}  # stage 1 needs whole prompts (no chunked prefill)


def make_cases(n_gqa: int = 9, n_mla: int = 3, seed: int = 2024) -> list[dict]:
    rng = random.Random(seed)
    cases = []
    for i in range(n_gqa):  # every selector once, shapes cycled then shuffled
        cases.append(dict(kind="gqa", selector=GQA_SELECTORS[i % len(GQA_SELECTORS)], page=PAGES[i % 4],
                          d=HEAD_DIMS[(i + 1) % 4], g=GROUPS[i % 3], hkv=rng.choice((1, 2)), seed=rng.randrange(10**6)))
    for i in range(n_mla):
        cases.append(dict(kind="mla", selector=MLA_SELECTORS[(i * 2 + 1) % len(MLA_SELECTORS)], page=rng.choice(PAGES),
                          d=288, g=rng.choice((1, 5)), hkv=1, seed=rng.randrange(10**6)))
    return cases


def make_steps(rng: random.Random, selector: str | None) -> list[tuple[list[int], list[int], int]]:
    """Step 1: two prompts (one split, chunked, unless the selector evicts). Step 2: a new prompt,
    the rest of the chunked one, a multi-token decode. Step 3: decodes of 1..3 tokens."""
    chunked = selector not in EVICTING
    a, b, c = rng.randint(12, 16), rng.randint(9, 13), rng.randint(5, 9)
    first = rng.randint(4, a - 4) if chunked else a
    steps = [([1, 2], [first, b], 2)]
    if chunked:
        steps.append(([3, 1, 2], [c, a - first, rng.randint(2, 3)], 2))
    else:
        steps.append(([3, 1, 2], [c, rng.randint(2, 3), 1], 1))
    steps.append(([1, 2, 3], [rng.randint(1, 3) for _ in range(3)], 0))
    return steps


def build(case: dict, backend: str) -> Engine:
    kind, page, hkv = case["kind"], case["page"], case["hkv"]
    name = case["selector"]
    if kind == "mla":
        spec = KVCacheSpec(num_layers=1, num_blocks=64, tokens_per_block=page, kind="mla", kv_lora_rank=256,
                           rope_dim=32, max_requests=4, max_blocks_per_seq=40)
    else:
        spec = KVCacheSpec(num_layers=1, num_blocks=64, tokens_per_block=page, num_kv_heads=hkv, head_dim=case["d"],
                           max_requests=4, max_blocks_per_seq=40)
    selector = "oracle_topk" if name == "oracle_topk_blocks" else name
    cfg = None if name is None else SparseAttentionConfig(selector, selector_params(name, page))
    plan = lower_config(cfg, num_layers=1, attention_kind=kind)[0]
    layer = SparseAttention(layer_idx=0, num_q_heads=hkv * case["g"], num_kv_heads=hkv, head_dim=case["d"],
                            plan=plan, backend=backend, kind=kind, kv_lora_rank=256 if kind == "mla" else 0)
    return Engine(KVCacheManager(spec), [layer], max_num_requests=4, max_num_tokens=128)


def positions_read(params, layer: SparseAttention, md, page: int) -> int:
    """Positions a backend reads, counted from the golden mask: exact (page=1) or whole touched
    pages clipped to each query's length (page-gathering kernels)."""
    hkv = layer.geometry.num_kv_heads
    lens = md.token_kv_lens.to(torch.int64)
    total = 0
    for i in range(md.num_seqs):
        t0, t1 = (int(x) for x in md.query_start_host[i: i + 2])
        kv = int(md.kv_lens_host[i])
        phase = "context" if i < md.num_contexts else "generation"
        sel = params if params is not None and params.selects_positions(phase) else None  # other phases: dense
        mask = selection_mask(sel, slice(t0, t1), md.token_kv_lens, kv, hkv)  # [Hkv, n, kv]
        n_pages = -(-kv // page)
        padded = torch.nn.functional.pad(mask, (0, n_pages * page - kv))
        touched = padded.view(hkv, t1 - t0, n_pages, page).any(-1)  # [Hkv, n, pages]
        start = torch.arange(n_pages) * page
        width = (lens[t0:t1].unsqueeze(1) - start).clamp(0, page)  # [n, pages] each page's valid span
        total += int((touched * width).sum())
    return total


def run(case: dict, backend: str):
    rng = random.Random(case["seed"])
    gen = torch.Generator().manual_seed(case["seed"])
    eng = build(case, backend)
    layer = eng.layers[0]
    hq, d = layer.geometry.num_q_heads, case["d"]
    outs = []
    for rids, lens, nctx in make_steps(rng, case["selector"]):
        n = sum(lens)
        q = torch.randn(n, hq, d, generator=gen)
        if case["kind"] == "mla":
            k, v = torch.randn(n, d, generator=gen), None
        else:
            k, v = torch.randn(n, case["hkv"], d, generator=gen), torch.randn(n, case["hkv"], d, generator=gen)
        extra = None
        if case["selector"] == "dsa":
            extra = IndexerInputs(q_index=torch.randn(n, 2, 8, generator=gen), k_index=torch.randn(n, 8, generator=gen),
                                  weights=torch.rand(n, 2, generator=gen))
        res = eng.step(rids, lens, nctx, [(q, k, v)], [extra])[0]
        page = eng.cache.tokens_per_block if layer.backend.kv_page_granular else 1
        read = positions_read(res.params, layer, eng.metadata, page)
        outs.append((res.out, res.lse, res.stats.attended, read))
    return outs


CASES = make_cases()


@pytest.mark.parametrize("case", CASES, ids=[f"{c['kind']}-{c['selector']}-p{c['page']}-d{c['d']}-g{c['g']}-h{c['hkv']}"
                                             for c in CASES])
def test_every_backend_equals_the_golden_and_reports_what_it_reads(case):
    golden = run(case, "vanilla")
    for step, (_, _, attended, read) in enumerate(golden):
        assert attended == read, f"vanilla step {step}: stats {attended} != positions read {read}"
    for backend in BACKENDS[1:]:
        got = run(case, backend)
        for step, ((o, lse, attended, read), (wo, wl, _, _)) in enumerate(zip(got, golden)):
            torch.testing.assert_close(o, wo, rtol=2e-4, atol=2e-4, msg=lambda m: f"{backend} step {step}: {m}")
            finite = torch.isfinite(wl)
            assert torch.equal(finite, torch.isfinite(lse))
            torch.testing.assert_close(lse[finite], wl[finite], rtol=2e-4, atol=2e-4)
            assert attended == read, f"{backend} step {step}: stats {attended} != positions read {read}"
