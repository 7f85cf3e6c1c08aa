"""The foreign-cache view and the vLLM step translation, without vLLM: kvsieve's own Engine over
its own cache is the reference; the same K/V live in a vLLM-CPU-layout tensor at the same
physical block ids, and the steps are handed over in vLLM's order (decode rows first)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvsieve import Engine, KVCacheManager, KVCacheSpec, SparseAttention, lower_config
from kvsieve.integrations.vllm.config import PluginConfig, parse_selector_spec
from kvsieve.integrations.vllm.layer import LayerRunner
from kvsieve.integrations.vllm.layouts import kv_views
from kvsieve.integrations.vllm.startup import lower_plans
from kvsieve.integrations.vllm.step import PreparedStep, StepTranslator, VllmStep
from kvsieve.metadata.foreign_paged import ForeignKVSpec, ForeignPagedKV
from kvsieve.sparse import AttentionGeometry, SparseAttentionConfig, get_backend
from kvsieve.sparse.backends import VanillaBackend

HKV, G, D, P, LAYERS, BLOCKS = 2, 2, 32, 32, 2, 64
# (request ids, query tokens) per step: prompts, a chunked prompt and decodes mixed, then decodes
STEPS = [((0, 1), (150, 90)), ((2, 0, 1), (70, 1, 1)), ((2, 0, 1), (40, 1, 1)), ((2, 0, 1), (1, 1, 1)),
         ((2, 0, 1), (1, 1, 1))]
TRITON_STEPS = [((0, 1), (100, 40)), ((2, 0, 1), (20, 1, 1)), ((2, 0, 1), (1, 1, 1))]
SELECTORS = [None, ("streaming", {"budget": 48, "num_sink": 4}), ("oracle_topk", {"budget": 40}),
             ("quest", {"budget": 64, "page_size": 16, "summary_dtype": "float32"}),
             ("block_select", {"block_size": 32, "topk_blocks": 2})]


def _foreign(layout: str = "vllm-cpu") -> ForeignPagedKV:
    spec = ForeignKVSpec(num_layers=LAYERS, num_blocks=BLOCKS, tokens_per_block=P, num_kv_heads=HKV, head_dim=D,
                         dtype=torch.float32, device=torch.device("cpu"), layout=layout, max_requests=8,
                         max_blocks_per_seq=32)
    return ForeignPagedKV(spec)


def _one_token_rule(lens, order, kv_lens: np.ndarray) -> np.ndarray:  # noqa: ANN001
    """int32 prompt lengths of the rows ``order`` of a step of query lengths ``lens``: a one-token row
    decodes (its prompt ended before it), any other row is a prompt (its prompt is its whole length)."""
    return np.array([kv - 1 if lens[j] == 1 else kv for j, kv in zip(order, kv_lens)], dtype=np.int32)


def _owner_cache(layout: str) -> torch.Tensor:
    """A NaN-filled cache as vLLM allocates it: CPU contiguous; Triton logical HND over NHD memory."""
    if layout == "vllm-cpu":
        return torch.full((BLOCKS, HKV, P, 2 * D), float("nan"))
    return torch.full((BLOCKS, P, HKV, 2 * D), float("nan")).transpose(1, 2)


# the Triton cases (the CUDA side's kernels on the CUDA side's layout) run in the interpreter: shorter steps
CASES = [("vllm-cpu", "torch", s) for s in SELECTORS] + [("vllm-triton", "triton", s) for s in SELECTORS[::3]]


@pytest.mark.parametrize("layout,backend,selector", CASES,
                         ids=lambda c: c if isinstance(c, str) else ("dense" if c is None else c[0]))
def test_view_matches_kvsieve_engine(layout, backend, selector):
    # both sides reduce in fp32 over different gather paths (the engine's grouped rows, the view's
    # per-row gather); one intra-op thread keeps each side's summation order fixed
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _check_view_matches_engine(layout, backend, selector)
    finally:
        torch.set_num_threads(threads)


class _TorchHost:
    """A plain-PyTorch stand-in for vLLM's kernels (:class:`~kvsieve.integrations.vllm.host.HostAttention`)
    over the same vllm-cpu cache: ``dense`` is the Vanilla golden with no selection in vLLM's
    order; ``paged_per_head`` reads the pseudo-blocks ``b * Hkv + h`` of the cache tensor one by one."""

    def __init__(self, step: PreparedStep, raw: torch.Tensor, layer_idx: int, q_vllm: torch.Tensor,
                 geometry: AttentionGeometry) -> None:
        self.step, self.raw, self.layer_idx, self.q, self.geometry = step, raw, layer_idx, q_vllm, geometry

    def dense(self) -> torch.Tensor:
        out = VanillaBackend().forward(self.step.to_kvsieve(self.q), self.step.metadata, self.layer_idx,
                                       self.geometry, None).out
        got = torch.empty_like(out)
        self.step.to_vllm(out, got)
        return got

    def paged_per_head(self, q: torch.Tensor, tables) -> torch.Tensor:  # noqa: ANN001
        n, hkv, p, two_d = self.raw.shape
        flat = self.raw.reshape(n * hkv, 2, p * (two_d // 2))
        k = flat[:, 0].reshape(n * hkv, -1, p).transpose(1, 2)  # K stored [D, block] per (block, head)
        v = flat[:, 1].reshape(n * hkv, p, -1)
        out = torch.empty_like(q)
        for i in range(q.shape[0]):
            length = int(tables.seq_lens[i])
            ids = tables.block_table[i, : -(-length // p)].long()
            kk, vv = k[ids].reshape(-1, k.shape[-1])[:length], v[ids].reshape(-1, v.shape[-1])[:length]
            out[i] = torch.softmax(q[i] @ kk.T * self.geometry.sm_scale, dim=-1) @ vv
        return out


HOST_SELECTORS = [None, ("quest", {"budget": 64, "page_size": P, "summary_dtype": "float32"}),
                  ("block_select", {"block_size": P, "topk_blocks": 2}),
                  ("quest", {"budget": 64, "page_size": 16, "summary_dtype": "float32"}),
                  ("streaming", {"budget": 48, "num_sink": 4}), ("oracle_topk", {"budget": 40}),
                  ("oracle_topk", {"budget": 40}, ("generation",))]  # (name, params[, phases])


@pytest.mark.parametrize("selector", HOST_SELECTORS, ids=lambda c: "dense" if c is None else "-".join(map(str, c)))
def test_host_paths_match_kvsieve_engine(selector):
    """With the host's kernels (a plain-PyTorch stand-in here; vLLM's own in test_plugin/test_engine):
    dense phases take ``host_dense``, decode rows selecting whole cache blocks ``host_paged``, decode
    rows selecting other positions (tokens, smaller pages) ``native_runs`` (both next to the dense
    prompt rows of a mixed step), selecting prompt rows ``native_runs`` too (each row with its causal
    length); every output equals kvsieve's own engine on its own cache."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _check_view_matches_engine("vllm-cpu", "torch", selector, host=True)
    finally:
        torch.set_num_threads(threads)


HIDDEN = 48  # the DSA cases' hidden size


def _dsa_projections(path) -> str:  # noqa: ANN001
    """Random index projections (2 heads x 16, RoPE on 8 channels) for every layer, saved as
    ``kvsieve distill-indexer`` saves them."""
    from kvsieve.selectors.dsa.projections import IndexerProjections, save_projections

    torch.manual_seed(3)
    save_projections(str(path), {i: IndexerProjections(HIDDEN, 2, 16, 8) for i in range(LAYERS)})
    return str(path)


@pytest.mark.parametrize("phases", [None, ("generation",)], ids=["all", "generation"])
@pytest.mark.parametrize("host", [False, True], ids=["backend", "host"])
def test_dsa_view_matches_kvsieve_engine(tmp_path, host, phases):
    """DSA served by the plug-in: each layer call, fed the layer's hidden state as the plug-in feeds
    it (vLLM's token order, reordered like q), selects what kvsieve's own DSA layer selects on the
    same cache (the same positions attended) and gives its output; its index keys live in the
    view's auxiliary pool at vLLM's physical block ids."""
    params = {"index_topk": 24, "projections": _dsa_projections(tmp_path / "indexer.pt")}  # geometry: the file's
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _check_view_matches_engine("vllm-cpu", "torch", ("dsa", params, phases), host=host)
    finally:
        torch.set_num_threads(threads)


def _check_view_matches_engine(layout, backend, selector, host=False):
    from kvsieve.selectors.dsa import IndexerInputs

    gen = torch.Generator().manual_seed(0)
    reads_hidden = selector is not None and selector[0] == "dsa"
    cfg = None if selector is None else SparseAttentionConfig(selector[0], selector[1], phases=(
        selector[2] if len(selector) > 2 else None))
    spec = KVCacheSpec(num_layers=LAYERS, num_blocks=BLOCKS, tokens_per_block=P, num_kv_heads=HKV, head_dim=D,
                       max_requests=8, max_blocks_per_seq=32)
    cache = KVCacheManager(spec)
    layers = [SparseAttention(layer_idx=i, num_q_heads=HKV * G, num_kv_heads=HKV, head_dim=D, plan=p, backend="torch")
              for i, p in enumerate(lower_config(cfg, num_layers=LAYERS))]
    engine = Engine(cache, layers, max_num_requests=8, max_num_tokens=512)

    raw = [_owner_cache(layout) for _ in range(LAYERS)]
    view = _foreign(layout)
    translator = StepTranslator(view, max_num_tokens=512, translations=tuple(
        {*get_backend(backend).required_translations, *(("block_lists",) if host else ())}))
    plans = lower_plans(PluginConfig(sparse=cfg), num_layers=LAYERS, backend_name="torch")
    geometry = AttentionGeometry(kind="gqa", num_q_heads=HKV * G, num_kv_heads=HKV, head_dim=D, sm_scale=D ** -0.5)
    runners = [LayerRunner(layer_idx=i, geometry=geometry, plan=p, backend=get_backend(backend))
               for i, p in enumerate(plans)]
    sparse_seen = False
    paths_seen: set[tuple[str, str]] = set()
    for rids, lens in STEPS if backend == "torch" else TRITON_STEPS:
        n_ctx = sum(n > 1 for n in lens)
        md = engine.begin_step(list(rids), list(lens), n_ctx)
        t = md.num_tokens
        qkv = [(torch.randn(t, HKV * G, D, generator=gen), torch.randn(t, HKV, D, generator=gen),
                torch.randn(t, HKV, D, generator=gen)) for _ in range(LAYERS)]
        hidden = [torch.randn(t, HIDDEN, generator=gen) if reads_hidden else None for _ in range(LAYERS)]
        ref = [layer.forward(q, k, v, md, model_inputs=None if h is None else IndexerInputs(hidden=h))
               for layer, (q, k, v), h in zip(layers, qkv, hidden)]
        engine.end_step()
        # the owner's cache: the same K/V at the same physical blocks, written through the views
        blk, off = cache.physical(md.slots[md.token_to_req_host], md.positions_host)
        for i, (_, k, v) in enumerate(qkv):
            view.bind_layer(i, raw[i], *kv_views(layout, raw[i]))
            view.k_cache(i)[blk, :, off] = k
            view.v_cache(i)[blk, :, off] = v
        # vLLM's order: decode rows first, then the prompt rows
        order = [j for j, n in enumerate(lens) if n == 1] + [j for j, n in enumerate(lens) if n > 1]
        qs = np.concatenate([[0], np.cumsum(lens)])
        tok = np.concatenate([np.arange(qs[j], qs[j + 1]) for j in order])
        slots = cache.slots([rids[j] for j in order])
        kv_lens = cache.valid_lens[slots].copy()
        step = VllmStep(np.concatenate([[0], np.cumsum([lens[j] for j in order])]).astype(np.int32),
                        kv_lens, cache.block_table[slots].copy(), prompt_lens=_one_token_rule(lens, order, kv_lens))
        prepared = translator.prepare(step)
        assert translator.prepare(step) is prepared  # once per step, shared by the layers
        kmd = prepared.metadata
        for i, (q, k, v) in enumerate(qkv):
            on_host = _TorchHost(prepared, raw[i], i, q[tok], geometry) if host else None
            fed = None if hidden[i] is None else IndexerInputs(hidden=prepared.to_kvsieve(hidden[i][tok]))
            res = runners[i].forward(prepared.to_kvsieve(q[tok]), prepared.to_kvsieve(k[tok]),
                                     prepared.to_kvsieve(v[tok]), prepared, on_host, model_inputs=fed)
            out = res.out
            got = torch.empty_like(out)
            prepared.to_vllm(out, got)
            last = ref[i]
            torch.testing.assert_close(got, last.out[tok], rtol=1e-5, atol=1e-5)
            for phase in kmd.phases():
                selects = last.params is not None and last.params.selects_positions(phase)
                paths_seen.add((phase, res.paths[phase]))
                if host:  # dense phases on the host; whole-block decode selections on its paged kernel; other
                    # decode selections, and selecting prompt rows, on kvsieve's native kernel over runs
                    whole = last.params is not None and last.params.sparse_attn_indices_block_size == P
                    expected = ("host_dense" if not selects else "native_runs" if phase == "context"
                                else "host_paged" if whole else "native_runs")
                    assert res.paths[phase] == expected, (phase, res.paths)
                    continue
                # prompt rows the plan does not select took the block-wise SDPA path, the others the backend
                assert (res.paths[phase] == "sdpa_dense") == (phase == "context" and not selects), (phase, res.paths)
            if reads_hidden:  # token selections: both sides count exactly the positions selected
                assert int(res.attended.sum()) == last.stats.attended
            if last.params is not None and last.params.sparse_attn_indices is not None:
                sparse_seen |= last.stats.attended < last.stats.dense
                # the plug-in's backend read fewer positions than dense too (page-granular backends round up)
                assert int(res.attended.sum()) < last.stats.dense
    assert sparse_seen == (selector is not None)  # every selector really skipped positions
    # every case mixes a chunked prompt with decode rows: both phases ran, and a generation-only
    # selector's decode rows went through the backend on the sub-step next to SDPA prompt rows
    assert {p for p, _ in paths_seen} == {"context", "generation"}
    if host:
        whole_pages = selector is not None and selector[1].get("page_size", selector[1].get("block_size")) == P
        assert (("generation", "host_paged") in paths_seen) == whole_pages
        assert (("generation", "native_runs") in paths_seen) == (selector is not None and not whole_pages)
    elif selector is None or selector[0] == "quest":
        assert ("context", "sdpa_dense") in paths_seen


def test_view_refuses_copies_writes_and_overflow():
    raw = torch.zeros(BLOCKS, HKV, P, 2 * D)
    view = _foreign()
    k, v = kv_views("vllm-cpu", raw)
    with pytest.raises(ValueError, match="not a view"):
        view.bind_layer(0, raw, k.clone(), v)
    view.bind_layer(0, raw, k, v)
    for call in (view.write, view.compact, view.truncate):
        with pytest.raises(RuntimeError, match="owning engine|owns"):
            call(0)
    table = np.zeros((1, 2), dtype=np.int32)
    with pytest.raises(ValueError, match="needs 3 blocks"):
        view.set_batch(table, np.array([70], dtype=np.int32))
    assert view._num_rows == 0 and not view.valid_lens.any()  # the failed call changed nothing


def test_cpu_layout_view_reads_transposed_k():
    raw = torch.arange(3 * 2 * 32 * 8, dtype=torch.float32).view(3, 2, 32, 8)  # D = 4
    k, v = kv_views("vllm-cpu", raw)
    flat = raw.view(3, 2, 2 * 32 * 4)
    assert k[1, 1, 5, 3] == flat[1, 1, 3 * 32 + 5]  # K element (p=5, d=3) at d*block_size + p
    assert v[2, 0, 7, 2] == flat[2, 0, 32 * 4 + 7 * 4 + 2]
    assert k.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()


@pytest.mark.parametrize("spec,message", [
    ("snapkv", "evicts prompt tokens"),
    ("rocketkv", "evicts prompt tokens"),
    ("skip_softmax:threshold_scale_factor_generation=1.0", "only the 'triton' backend"),
])
def test_refused_selectors(spec, message):
    with pytest.raises(ValueError, match=message):
        lower_plans(PluginConfig(sparse=parse_selector_spec(spec)), num_layers=2, backend_name="torch")


def test_selector_not_per_kv_head_is_refused_under_tensor_parallelism(monkeypatch):
    """A selector that does not declare Capabilities(per_kv_head=True) is refused by name when each
    worker holds a shard of the heads (tensor_parallel_size > 1), and runs with one worker."""
    from dataclasses import replace

    from kvsieve.selectors.streaming.selector import StreamingSelector

    config = PluginConfig(sparse=parse_selector_spec("streaming:budget=48"))
    assert lower_plans(config, num_layers=2, backend_name="torch", tensor_parallel_size=2)[0] is not None
    monkeypatch.setattr(StreamingSelector, "capabilities", replace(StreamingSelector.capabilities, per_kv_head=False))
    with pytest.raises(ValueError, match="selector 'streaming' cannot run under tensor parallelism "
                                         r"\(tensor_parallel_size=2\).*per_kv_head=True"):
        lower_plans(config, num_layers=2, backend_name="torch", tensor_parallel_size=2)
    assert lower_plans(config, num_layers=2, backend_name="torch")[1].selector.name == "streaming"


def _vllm_config(**parallel: int) -> SimpleNamespace:
    """The fields of vLLM's config the plug-in's per-process state reads (plain attributes)."""
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=256, hf_config=SimpleNamespace(num_hidden_layers=2)),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=256),
        parallel_config=SimpleNamespace(**{"decode_context_parallel_size": 1, "prefill_context_parallel_size": 1,
                                           **parallel}))


def test_worker_state_refuses_at_start_up_by_name(monkeypatch):
    """Each worker's state (built when vLLM builds its first attention layer) refuses context
    parallelism and, on a tensor-parallel worker, a selector without per_kv_head; a worker's ranks
    reach every layer's runner."""
    from dataclasses import replace

    from kvsieve.integrations.vllm.config import WorkerRanks
    from kvsieve.integrations.vllm.state import PluginState
    from kvsieve.selectors.streaming.selector import StreamingSelector

    config = PluginConfig(sparse=parse_selector_spec("streaming:budget=48"))
    ranks = WorkerRanks(tp_rank=1, tp_size=2, pp_rank=0, pp_size=1)
    state = PluginState(config, _vllm_config(), torch.device("cpu"), ranks)
    geometry = AttentionGeometry(kind="gqa", num_q_heads=2, num_kv_heads=1, head_dim=32, sm_scale=1.0)
    assert state.runner(1, geometry).ranks == ranks
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        with pytest.raises(NotImplementedError, match=f"{name}=2 is not supported"):
            PluginState(config, _vllm_config(**{name: 2}), torch.device("cpu"))
    monkeypatch.setattr(StreamingSelector, "capabilities", replace(StreamingSelector.capabilities, per_kv_head=False))
    with pytest.raises(ValueError, match="selector 'streaming' cannot run under tensor parallelism"):
        PluginState(config, _vllm_config(), torch.device("cpu"), ranks)
    assert PluginState(config, _vllm_config(), torch.device("cpu")).plans[0].selector.name == "streaming"


def test_per_layer_plans_from_a_config_file(tmp_path, monkeypatch):
    from kvsieve.integrations.vllm.config import read_plugin_config

    path = tmp_path / "plan.json"
    path.write_text('{"selector": "quest", "params": {"budget": 64}, "dense_layers": [0, -1], "backend": "torch"}')
    config = read_plugin_config({"KVSIEVE_CONFIG": str(path)})
    plans = lower_plans(config, num_layers=4, backend_name=config.backend)
    assert [p is None for p in plans] == [True, False, False, True]
    assert plans[1].selector.config.budget == 64 and plans[1] is plans[2]  # one selector, as in kvsieve
    with pytest.raises(ValueError, match="contradicts"):
        read_plugin_config({"KVSIEVE_CONFIG": str(path), "KVSIEVE_BACKEND": "vanilla"})


@pytest.mark.parametrize("where", ["predict_kv", "sparse_kv_indices from predict_attn"])
def test_undeclared_eviction_is_refused(where):
    """A selector that keeps prompt tokens without declaring evicts=True — through predict_kv, or
    through the prompt-eviction fields of its predict_attn answer — is refused by the layer
    (lower_plans refuses only the declared ones); nothing is attended and the cache is untouched."""
    from dataclasses import replace

    from kvsieve.selectors.streaming.selector import StreamingSelector
    from kvsieve.sparse import LayerPlan

    def first_half(inputs):
        n = int(inputs.metadata.kv_lens_host[0]) // 2
        return torch.arange(n, dtype=torch.int32).expand(HKV, n).contiguous(), torch.tensor([0, n], dtype=torch.int32)

    class KeepsFirstHalf(StreamingSelector):
        def predict_kv(self, inputs):
            return first_half(inputs) if where == "predict_kv" else None

        def predict_attn(self, inputs):
            params = super().predict_attn(inputs)
            if where == "predict_kv":
                return params
            indices, offsets = first_half(inputs)
            return replace(params, sparse_kv_indices=indices, sparse_kv_offsets=offsets)

    raw = torch.randn(BLOCKS, HKV, P, 2 * D)
    before = raw.clone()
    view = _foreign()
    view.bind_layer(0, raw, *kv_views("vllm-cpu", raw))
    translator = StepTranslator(view, max_num_tokens=512, translations=get_backend("torch").required_translations)
    prepared = translator.prepare(VllmStep(np.array([0, 40], dtype=np.int32), np.array([40], dtype=np.int32),
                                           np.array([[1, 2]], dtype=np.int32), prompt_lens=np.array([40], np.int32)))
    geometry = AttentionGeometry(kind="gqa", num_q_heads=HKV * G, num_kv_heads=HKV, head_dim=D, sm_scale=D ** -0.5)
    plan = LayerPlan(KeepsFirstHalf(budget=16, num_sink=4), frozenset({"context", "generation"}))
    runner = LayerRunner(layer_idx=0, geometry=geometry, plan=plan, backend=get_backend("torch"))
    q, k = torch.randn(40, HKV * G, D), torch.randn(40, HKV, D)
    with pytest.raises(ValueError, match=f"{where}.*eviction is refused"):
        runner.forward(q, k, k, prepared)
    assert torch.equal(raw, before) and view.valid_lens[0] == 40  # the owner's cache and lengths as they were


def test_config_file_knobs_are_checked_not_coerced(tmp_path):
    from kvsieve.integrations.vllm.config import read_plugin_config

    path = tmp_path / "plan.json"
    path.write_text('{"selector": "quest", "params": {"budget": 64}, "dense_layers": [1.5]}')
    with pytest.raises(ValueError, match=r"dense_layers must be a tuple of ints, got tuple \(1.5,\)"):
        read_plugin_config({"KVSIEVE_CONFIG": str(path)})


def test_rows_are_split_at_their_prompt_length():
    """With each request's prompt length known, a query token before it is a context token and every
    later one a generation token, whatever the row's length: a recomputed request (prompt and
    generated tokens in one row) is two requests over the same blocks, and a one-token row that is
    a prompt's last token is a context row. A step is not built without every row's prompt length
    (no fallback to vLLM's one-token rule)."""
    view = _foreign()
    translator = StepTranslator(view, max_num_tokens=512, translations=get_backend("torch").required_translations)
    table = np.array([[1, 2], [3, 4], [5, 6]], dtype=np.int32)
    # vLLM rows: a decode row (position 40 >= prompt 30), a recompute of prompt 20 + 5 generated tokens,
    # a prompt's last token (position 9 of a 10-token prompt)
    qsl, lens, prompts = (np.array(x, dtype=np.int32) for x in ([0, 1, 26, 27], [41, 25, 10], [30, 20, 10]))
    step = VllmStep(qsl, lens, table, prompt_lens=prompts)
    assert step.context_tokens.tolist() == [0, 20, 1] and not step.decode_only
    prepared = translator.prepare(step)
    md = prepared.metadata
    # requests: row 1's prompt part, row 2's token (context); row 0's token, row 1's generated part
    assert md.num_contexts == 2 and md.seq_lens.tolist() == [20, 1, 1, 5]
    assert md.kv_lens_host.tolist() == [20, 10, 41, 25]
    assert prepared.token_order.tolist() == [*range(1, 21), 26, 0, *range(21, 26)]
    assert md.positions_host.tolist() == [*range(20), 9, 40, *range(20, 25)]
    assert view.block_table[md.slots[:4], :2].tolist() == [[3, 4], [5, 6], [1, 2], [3, 4]]
    with pytest.raises(TypeError, match="prompt_lens"):
        VllmStep(qsl, lens, table)
    with pytest.raises(ValueError, match="2 prompt lengths for 3 rows"):
        VllmStep(qsl, lens, table, prompt_lens=prompts[:2])
    assert translator.prepare(step) is prepared  # nothing refused changed the prepared step
    decoding = VllmStep(np.array([0, 1, 2], dtype=np.int32), np.array([31, 21], dtype=np.int32), table[:2],
                        prompt_lens=np.array([30, 20], dtype=np.int32))
    assert decoding.decode_only and translator.prepare(decoding).metadata.num_contexts == 0
