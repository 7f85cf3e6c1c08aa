"""The ``dsa`` selector through kvsieve's layer and engine: index-K aux pool, logits paths
(ragged prefill, paged decode, chunked), short-sequence fast path, engines, configuration errors."""
from __future__ import annotations

import pytest
import torch

from kvsieve import Engine, KVCacheManager, KVCacheSpec, SparseAttention, SparseAttentionConfig, create_selector
from kvsieve import lower_config
from kvsieve.kernels.topk.naive import radix_topk
from kvsieve.selectors import IndexerInputs
from kvsieve.selectors.dsa.selector import INDEX_K_POOL, INDEX_K_SCALE_POOL

H, D, R, TOPK = 4, 32, 16, 48


class Rig:
    """One GQA layer (2 KV heads) with a ``dsa`` plan; remembers every token's index tensors."""

    def __init__(self, **cfg):
        spec = KVCacheSpec(num_layers=1, num_blocks=160, tokens_per_block=16, num_kv_heads=2, head_dim=16,
                           max_requests=4, max_blocks_per_seq=32)
        self.cache = KVCacheManager(spec)
        params = dict(index_topk=TOPK, n_heads=H, head_dim=D, rope_dim=R) | cfg
        self.plan = lower_config(SparseAttentionConfig("dsa", params), num_layers=1)[0]
        self.layer = SparseAttention(layer_idx=0, num_q_heads=4, num_kv_heads=2, head_dim=16, plan=self.plan)
        self.engine = Engine(self.cache, [self.layer], max_num_requests=4, max_num_tokens=512)
        self.g = torch.Generator().manual_seed(0)
        self.hist: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    @property
    def selector(self):
        return self.plan.selector

    def step(self, rids, lens, num_contexts):
        t = sum(lens)
        q, k, w = torch.randn(t, H, D, generator=self.g), torch.randn(t, D, generator=self.g), \
            torch.rand(t, H, generator=self.g)
        md = self.engine.begin_step(rids, lens, num_contexts)
        qkv = [torch.randn(t, *s, generator=self.g) for s in ((4, 16), (2, 16), (2, 16))]
        res = self.layer.forward(*qkv, md, model_inputs=IndexerInputs(q_index=q, k_index=k, weights=w))
        self.engine.end_step()
        t0 = 0
        for rid, n in zip(rids, lens):
            self.hist.setdefault(rid, []).append((q[t0:t0 + n], k[t0:t0 + n], w[t0:t0 + n]))
            t0 += n
        return res.params

    def expected(self, rid, n_last):
        """Radix top-k of fp32 logits computed from the remembered tensors, last ``n_last`` rows."""
        q, k, w = (torch.cat(x) for x in zip(*self.hist[rid]))
        total = k.shape[0]
        logits = torch.einsum("th,ths->ts", w, torch.einsum("thd,sd->ths", q, k).relu())[-n_last:]
        lens = torch.arange(total - n_last, total, dtype=torch.int32) + 1
        logits = logits.masked_fill(torch.arange(total) >= lens[:, None], float("-inf"))
        return radix_topk(logits.contiguous(), lens, TOPK)


def _sets(params, rows: range):
    idx, off = params.sparse_attn_indices, params.sparse_attn_offsets
    for h in range(idx.shape[0]):
        assert all(torch.equal(idx[0, off[t]:off[t + 1]], idx[h, off[t]:off[t + 1]]) for t in rows)
    return [{int(x) for x in idx[0, off[t]:off[t + 1]] if x >= 0} for t in rows]


def _overlap(got, want):
    return sum(len(a & b) / max(len(b), 1) for a, b in zip(got, want)) / len(want)


@pytest.mark.parametrize("cfg", [dict(index_k_dtype="float32", topk_engine="radix", logits_kernel="triton"),
                                 dict(index_k_dtype="float32", topk_engine="gvr", logits_kernel="triton",
                                      max_logits_elems=500),
                                 dict(index_k_dtype="float32")])
def test_selection_equals_exact_topk(cfg):
    rig = Rig(**cfg)
    rig.step([0, 1], [30, 70], 2)  # fresh prompts: ragged prefill path
    rig.step([0, 1], [1, 1], 0)  # decode: paged path
    p = rig.step([0, 2], [40, 60], 2)  # chunked prefill of request 0 (paged) + a new prompt (ragged)
    got = _sets(p, range(100))
    want0 = [{int(x) for x in row if x >= 0} for row in rig.expected(0, 40)]
    want2 = [{int(x) for x in row if x >= 0} for row in rig.expected(2, 60)]
    assert _overlap(got[:40], want0) > 0.995 and _overlap(got[40:], want2) > 0.995  # fp32 rounding only
    assert all(len(s) == min(TOPK, pos + 1) for s, pos in zip(got[40:], range(60)))
    assert rig.selector.stats.indexed_steps == 3 and rig.selector.stats.short_path_steps == 0
    assert rig.selector.topk_engine == cfg.get("topk_engine", "torch")


@pytest.mark.parametrize("k_dtype", ["bfloat16", "float8_e4m3"])
def test_low_precision_index_keys(k_dtype):
    rig = Rig(index_k_dtype=k_dtype)
    p = rig.step([0], [120], 1)
    pool = rig.cache.aux_pools[INDEX_K_POOL][0]
    assert pool.dtype == (torch.bfloat16 if k_dtype == "bfloat16" else torch.float8_e4m3fn)
    assert pool.shape == (160, 16, D)
    if k_dtype == "float8_e4m3":
        s = rig.cache.aux_pools[INDEX_K_SCALE_POOL][0]
        used = s[s > 0]
        assert used.numel() >= 120 and torch.equal(torch.exp2(torch.log2(used).round()), used)
    got = _sets(p, range(120))
    want = [{int(x) for x in row if x >= 0} for row in rig.expected(0, 120)]
    assert _overlap(got, want) > 0.9


def test_short_sequence_fast_path_selects_everything():
    rig = Rig()
    p = rig.step([0, 1], [TOPK, 10], 2)
    assert rig.selector.stats.short_path_steps == 1 and rig.selector.stats.last_short_path == {0: True}
    assert _sets(p, range(TOPK + 10)) == [set(range(t + 1)) for t in range(TOPK)] + [set(range(t + 1))
                                                                                       for t in range(10)]
    rig.step([0, 1], [1, 1], 0)  # request 0 now sees TOPK + 1 tokens: the indexer runs
    assert rig.selector.stats.last_short_path == {0: False}


def test_missing_inputs_and_bad_config():
    rig = Rig()
    md = rig.engine.begin_step([0], [4], 1)
    with pytest.raises(ValueError, match="layer 0: selector 'dsa' needs this step's IndexerInputs.*got none"):
        rig.layer.forward(torch.zeros(4, 4, 16), torch.zeros(4, 2, 16), torch.zeros(4, 2, 16), md)
    with pytest.raises(ValueError, match="needs this step's IndexerInputs.*got dict"):
        rig.layer.forward(torch.zeros(4, 4, 16), torch.zeros(4, 2, 16), torch.zeros(4, 2, 16), md,
                          model_inputs={"hidden": torch.zeros(4, 8)})
    assert rig.cache.aux_pools.get(INDEX_K_POOL) is None  # refused before anything was written
    rig.engine.abort_step()
    with pytest.raises(ValueError, match="index_k_dtype"):
        create_selector("dsa", index_k_dtype="int4")
    with pytest.raises(ValueError, match="compress_ratio"):
        create_selector("dsa", compress_ratio=4)
    with pytest.raises(ValueError, match="rope_dim"):
        create_selector("dsa", head_dim=32, rope_dim=48)
    with pytest.raises(ValueError, match="cute_gvr"):
        create_selector("dsa", topk_engine="cute_gvr")
    with pytest.raises(ValueError, match="either hidden"):
        IndexerInputs()
    sel = create_selector("dsa", n_heads=H, head_dim=D, rope_dim=R, index_topk=TOPK)
    with pytest.raises(RuntimeError, match="IndexerProjections"):
        rig2 = Rig()
        rig2.layer.forward(torch.zeros(4, 4, 16), torch.zeros(4, 2, 16), torch.zeros(4, 2, 16),
                           rig2.engine.begin_step([0], [4], 1), model_inputs=IndexerInputs(hidden=torch.zeros(4, 8)))
    assert sel.topk_engine == "torch"


def _snapshot(rig):
    return (rig.cache.valid_len(0), rig.cache.aux_pools[INDEX_K_POOL][0].clone())


def test_model_inputs_do_not_leak_into_the_next_step():
    """Inputs go with one step only: a later step without them is refused (the old per-selector
    stash handed a failed step's inputs to the next one), and the refusal changes nothing."""
    rig = Rig()
    rig.step([0], [20], 1)
    t = 3
    qkv = [(torch.randn(t, 4, 16), torch.randn(t, 2, 16), torch.randn(t, 2, 16))]
    ii = IndexerInputs(q_index=torch.randn(t, H, D), k_index=torch.randn(t, D), weights=torch.rand(t, H))
    bad_q = [(torch.zeros(t, 4, 16, dtype=torch.int32), *qkv[0][1:])]
    before = _snapshot(rig)
    with pytest.raises(TypeError, match="q must be a floating-point tensor"):
        rig.engine.step([0], [t], 0, bad_q, [ii])  # the step fails before the layer ran
    for extra in (None, [None]):
        with pytest.raises(ValueError, match="layer 0: selector 'dsa' needs this step's IndexerInputs"):
            rig.engine.step([0], [t], 0, qkv, extra)
        after = _snapshot(rig)
        assert after[0] == before[0] and torch.equal(after[1], before[1])
    (res,) = rig.engine.step([0], [t], 0, qkv, [ii])  # given with its own step, it is used
    assert res.params.sparse_attn_offsets.numel() == t + 1 and rig.cache.valid_len(0) == before[0] + t


def test_model_inputs_for_a_selector_that_reads_none_are_refused():
    spec = KVCacheSpec(num_layers=1, num_blocks=16, tokens_per_block=16, num_kv_heads=2, head_dim=16, max_requests=1,
                       max_blocks_per_seq=8)
    cache = KVCacheManager(spec)
    plan = lower_config(SparseAttentionConfig("streaming", {"budget": 8}), num_layers=1)[0]
    qkv = [(torch.randn(4, 4, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 16))]
    ii = IndexerInputs(q_index=torch.randn(4, H, D), k_index=torch.randn(4, D), weights=torch.rand(4, H))
    for layer_plan, who in ((plan, "selector 'streaming' reads none"), (None, "the layer is dense")):
        layer = SparseAttention(layer_idx=0, num_q_heads=4, num_kv_heads=2, head_dim=16, plan=layer_plan)
        engine = Engine(cache, [layer], max_num_requests=1, max_num_tokens=64)
        with pytest.raises(ValueError, match=f"layer 0: model_inputs \\(IndexerInputs\\) were given but {who}"):
            engine.step([0], [4], 1, qkv, [ii])
        assert cache.request_ids == []  # the refused step left no request behind
    with pytest.raises(ValueError, match="expected model_inputs for 1 layers"):
        engine.step([0], [4], 1, qkv, [None, None])


def test_geometry_comes_from_the_projections_file(tmp_path):
    """``dsa:projections=FILE,index_topk=K`` needs nothing else: the geometry fields left unset are
    the file's (every layer's), a field given that contradicts the file is refused naming both, and
    without a file the fields are DeepSeek-V3.2's."""
    from kvsieve.selectors.dsa import DSAConfig
    from kvsieve.selectors.dsa.projections import IndexerProjections, save_projections
    from kvsieve.sparse.knobs import KnobError

    path = tmp_path / "indexer.pt"
    save_projections(str(path), {i: IndexerProjections(24, 3, 16, 6, rope_theta=1e6, rope_interleave=True)
                                 for i in (2, 5)})
    c = DSAConfig(projections=str(path), index_topk=64)
    assert (c.n_heads, c.head_dim, c.rope_dim, c.rope_interleave, c.rope_theta) == (3, 16, 6, True, 1e6)
    assert DSAConfig(projections=str(path), head_dim=16).n_heads == 3  # agreeing fields are fine
    with pytest.raises(KnobError, match=r"dsa.n_heads=4 contradicts the projections file .*indexer.pt \(n_heads=3\)"):
        DSAConfig(projections=str(path), n_heads=4)
    d = DSAConfig()
    assert (d.n_heads, d.head_dim, d.rope_dim, d.rope_interleave, d.rope_theta) == (64, 128, 64, False, 10000.0)
    save_projections(str(path), {0: IndexerProjections(24, 3, 16, 6), 1: IndexerProjections(24, 2, 16, 6)})
    with pytest.raises(ValueError, match="layers have different indexer geometries"):
        DSAConfig(projections=str(path))


def test_default_rope_is_computed_once_a_step(tmp_path, monkeypatch):
    """Every layer of a step projects at the same positions: the default RoPE's cos/sin are computed
    once for them and the other layers' index tensors equal those each layer would compute alone;
    other positions (the next step) compute their own."""
    from kvsieve.selectors.dsa import projections as proj_mod
    from kvsieve.selectors.dsa import selector as sel_mod
    from kvsieve.selectors.dsa.projections import IndexerProjections, save_projections

    torch.manual_seed(0)
    path = tmp_path / "indexer.pt"
    save_projections(str(path), {i: IndexerProjections(24, 3, 16, 6) for i in (0, 1)})
    sel = create_selector("dsa", projections=str(path), index_topk=8)
    calls = []
    monkeypatch.setattr(sel_mod, "rope_cos_sin", lambda *a: calls.append(a[0].tolist()) or proj_mod.rope_cos_sin(*a))
    hidden = torch.randn(2, 24)
    for positions in ([40, 7], [40, 7], [41, 8]):
        pos = torch.tensor(positions)
        for layer in (0, 1):
            got = sel.index_tensors(layer, IndexerInputs(hidden=hidden), pos)
            cos, sin = proj_mod.rope_cos_sin(pos, 6, 10000.0)
            want = sel.index_tensors(layer, IndexerInputs(hidden=hidden, cos=cos, sin=sin), pos)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert calls == [[40, 7], [41, 8]]


def test_cpu_decode_step_projects_natively(tmp_path):
    """A CPU step of at most MAX_TOKENS tokens is projected by the native kernel (its bits, which
    are not torch's matmul's), a longer one by the module; both agree with the module to fp32
    rounding. A layer whose queries read another input (q_input) always takes the module."""
    from kvsieve.kernels.common.native import NativeUnavailable
    from kvsieve.kernels.indexer_project.native import MAX_TOKENS, indexer_project_native, pack_weight
    from kvsieve.selectors.dsa.projections import IndexerProjections, rope_cos_sin, save_projections

    torch.manual_seed(1)
    path = tmp_path / "indexer.pt"
    proj = IndexerProjections(96, 4, 32, 16)
    save_projections(str(path), {0: proj})
    sel = create_selector("dsa", projections=str(path), index_topk=8)
    p = sel.projections[0]
    for t in (1, 5, MAX_TOKENS + 1):
        hidden = torch.randn(t, 96).to(torch.bfloat16)
        pos = torch.randint(0, 9000, (t,))
        got = sel.index_tensors(0, IndexerInputs(hidden=hidden), pos)
        cos, sin = rope_cos_sin(pos, 16, 10000.0)
        with torch.no_grad():
            module = p(hidden, pos, None, cos, sin)
        for g, m in zip(got, module):
            assert torch.allclose(g, m, rtol=1e-5, atol=1e-5)
        if t > MAX_TOKENS:
            assert all(torch.equal(g, m) for g, m in zip(got, p(hidden, pos, None, cos, sin, stacked=p.stacked_weight())))
            continue
        try:
            kernel = indexer_project_native(hidden, pack_weight(p.stacked_weight()), p.k_norm.weight, p.k_norm.bias,
                                            p.k_norm.eps, cos, sin, 4, 32, 16, 32 ** -0.5 * 4 ** -0.5)
        except NativeUnavailable as e:
            pytest.skip(f"native kernel unavailable: {e}")
        assert all(torch.equal(g, k) for g, k in zip(got, kernel))
        assert not all(torch.equal(g, m) for g, m in zip(got, module))  # the kernel's sums, not torch's


def test_a_key_norm_the_kernel_does_not_compute_takes_the_module_and_q_rounding_is_fp32_or_bf16(tmp_path):
    """A layer whose key norm is neither none nor an affine LayerNorm (here an RMSNorm) is projected by
    its module, norm included, not by the kernel (which would skip the norm); ``index_tensors`` rounds q
    to fp32 or bf16 only and refuses another ``q_dtype`` by name."""
    from kvsieve.selectors.dsa.projections import IndexerProjections, rope_cos_sin, save_projections

    torch.manual_seed(3)
    path = tmp_path / "indexer.pt"
    save_projections(str(path), {0: IndexerProjections(64, 2, 16, 8)})
    sel = create_selector("dsa", projections=str(path), n_heads=2, head_dim=16, rope_dim=8, index_topk=8)
    p = sel.projections[0]
    p.k_norm = torch.nn.RMSNorm(16)
    with torch.no_grad():
        p.k_norm.weight.uniform_(0.5, 1.5)
    sel.set_projections({0: p})
    hidden, pos = torch.randn(1, 64).to(torch.bfloat16), torch.tensor([300])
    got = sel.index_tensors(0, IndexerInputs(hidden=hidden), pos)
    cos, sin = rope_cos_sin(pos, 8, 10000.0)
    with torch.no_grad():
        want = p(hidden, pos, None, cos, sin, stacked=p.stacked_weight())
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    rounded = sel.index_tensors(0, IndexerInputs(hidden=hidden), pos, q_dtype=torch.bfloat16)
    assert torch.equal(rounded[0], want[0].to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="q_dtype=torch.float8_e4m3fn"):
        sel.index_tensors(0, IndexerInputs(hidden=hidden), pos, q_dtype=torch.float8_e4m3fn)


def test_projections_load_in_fp32_under_a_bf16_default_dtype(tmp_path):
    """A vLLM worker builds the model, and the plug-in its selector, with torch's default dtype set to
    the model's: the saved fp32 indexer still loads as fp32, bit for bit, and a decode step on the CPU
    takes the native projection (its bits) rather than a bf16 matmul."""
    from kvsieve.kernels.common.native import NativeUnavailable
    from kvsieve.kernels.indexer_project.native import indexer_project_native, pack_weight
    from kvsieve.selectors.dsa.projections import IndexerProjections, rope_cos_sin, save_projections

    torch.manual_seed(2)
    path = tmp_path / "indexer.pt"
    saved = IndexerProjections(64, 2, 16, 8)
    save_projections(str(path), {0: saved})
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        sel = create_selector("dsa", projections=str(path), n_heads=2, head_dim=16, rope_dim=8, index_topk=8)
    finally:
        torch.set_default_dtype(before)
    p = sel.projections[0]
    assert all(v.dtype == torch.float32 for v in p.state_dict().values())
    assert all(torch.equal(v, saved.state_dict()[k]) for k, v in p.state_dict().items())
    hidden, pos = torch.randn(1, 64).to(torch.bfloat16), torch.tensor([300])
    got = sel.index_tensors(0, IndexerInputs(hidden=hidden), pos)
    cos, sin = rope_cos_sin(pos, 8, 10000.0)
    try:
        want = indexer_project_native(hidden, pack_weight(saved.stacked_weight()), saved.k_norm.weight,
                                      saved.k_norm.bias, saved.k_norm.eps, cos, sin, 2, 16, 8, 16 ** -0.5 * 2 ** -0.5)
    except NativeUnavailable as e:
        pytest.skip(f"native kernel unavailable: {e}")
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_index_keys_are_index_tensors_keys_without_the_queries(tmp_path, monkeypatch):
    """``index_keys`` gives ``index_tensors``' k bit for bit on every path (native call, the module's
    stacked matmul, a separate query input, finished tensors), and a step no phase of which selects
    (a decode-only DSA's prompt) writes those keys without projecting a query: its pool equals a
    selecting plan's after the same prompt, though ``index_tensors`` is never called for it."""
    from kvsieve.kernels.indexer_project.native import MAX_TOKENS
    from kvsieve.selectors.dsa.projections import IndexerProjections, save_projections

    torch.manual_seed(5)
    path = tmp_path / "indexer.pt"
    save_projections(str(path), {0: IndexerProjections(96, 4, 32, 16)})
    sel = create_selector("dsa", projections=str(path), index_topk=8)
    for t in (5, MAX_TOKENS + 40):
        hidden, pos = torch.randn(t, 96).to(torch.bfloat16), torch.randint(0, 9000, (t,))
        for ii in (IndexerInputs(hidden=hidden), IndexerInputs(hidden=hidden, q_input=torch.randn(t, 96)),
                   IndexerInputs(q_index=torch.randn(t, 4, 32), k_index=torch.randn(t, 32),
                                 weights=torch.rand(t, 4))):
            assert torch.equal(sel.index_keys(0, ii, pos), sel.index_tensors(0, ii, pos)[1])
    with pytest.raises(ValueError, match=r"keys: stacked must be \[164, 96\]"):
        sel.projections[0].keys(hidden, pos, stacked=torch.zeros(100, 96))

    def pools(phases, refuse_tensors):
        spec = KVCacheSpec(num_layers=1, num_blocks=32, tokens_per_block=16, num_kv_heads=2, head_dim=16,
                           max_requests=2, max_blocks_per_seq=16)
        cache = KVCacheManager(spec)
        plan = lower_config(SparseAttentionConfig("dsa", dict(projections=str(path), index_topk=8), phases=phases),
                            num_layers=1)[0]
        if refuse_tensors:
            def refuse(*a, **k):
                raise AssertionError("a step that selects nowhere projected its queries")
            monkeypatch.setattr(plan.selector, "index_tensors", refuse)
        layer = SparseAttention(layer_idx=0, num_q_heads=4, num_kv_heads=2, head_dim=16, plan=plan)
        engine = Engine(cache, [layer], max_num_requests=2, max_num_tokens=256)
        g = torch.Generator().manual_seed(1)
        t = 150
        md = engine.begin_step([0], [t], 1)
        qkv = [torch.randn(t, *s, generator=g) for s in ((4, 16), (2, 16), (2, 16))]
        hidden = torch.randn(t, 96, generator=g).to(torch.bfloat16)
        layer.forward(*qkv, md, model_inputs=IndexerInputs(hidden=hidden))
        engine.end_step()
        return cache.aux_pools[INDEX_K_POOL][0].clone()

    assert torch.equal(pools(("generation",), True), pools(None, False))
