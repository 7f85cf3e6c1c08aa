"""The plug-in's native decode path (one call per layer: state update, selection, attention) against
its Python twin, without vLLM: two identical sides hold the same K/V in vLLM-CPU-layout caches at
the same physical blocks; both run the prompts through :class:`LayerRunner`, then side A runs every
decode step through :class:`LayerRunner` (the selector's hooks, the carrier, the kvsieve backend)
and side B through :func:`decode_layer_path`. Each decode call must attend the same positions per
(row, KV head), give the same output, and leave the selector's pools (page summaries, index keys)
equal."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsieve.integrations.vllm.config import PluginConfig
from kvsieve.integrations.vllm.host import token_runs
from kvsieve.integrations.vllm.layer import LayerRunner
from kvsieve.integrations.vllm.layouts import kv_views
from kvsieve.integrations.vllm.native_decode import decode_layer_path
from kvsieve.integrations.vllm.request_settings import RequestSetting
from kvsieve.integrations.vllm.setting_groups import one_setting, plan_with_setting
from kvsieve.integrations.vllm.startup import lower_plans
from kvsieve.integrations.vllm.state_check import StateCheck
from kvsieve.integrations.vllm.step import StepTranslator, VllmStep
from kvsieve.kernels.common.native import native_status
from kvsieve.kernels.decode_layer.native import SOURCE
from kvsieve.metadata.foreign_paged import ForeignKVSpec, ForeignPagedKV
from kvsieve.selectors.dsa import IndexerInputs
from kvsieve.sparse import AttentionGeometry, SparseAttentionConfig, get_backend

pytestmark = pytest.mark.skipif(native_status(SOURCE) != "native", reason="no C compiler for the native kernel")

HKV, G, D, P, LAYERS, BLOCKS = 2, 3, 32, 32, 2, 48
PROMPTS = (300, 170, 75)  # three requests, then DECODES decode steps of all three
DECODES = 4
SELECTORS = [
    ("quest", {"budget": 64, "page_size": 16}),
    ("quest", {"budget": 64, "page_size": 16, "summary_dtype": "float32"}),
    ("quest", {"budget": 96, "page_size": 32}),
    ("streaming", {"budget": 48, "num_sink": 4}),
    ("streaming", {"budget": 40, "num_sink": 0}),
    ("oracle_topk", {"budget": 40}),
    ("oracle_topk", {"budget": 64, "block_size": 8}),
    ("block_select", {"block_size": 32, "topk_blocks": 3}),
    ("block_select", {"block_size": 16, "topk_blocks": 4, "init_blocks": 1, "score_type": "mean"}),
    ("block_select", {"block_size": 64, "topk_blocks": 2, "scoring": "summary"}),
    ("dsa", {"index_topk": 48}),
]


def _projections(path) -> str:  # noqa: ANN001
    """Random index projections (4 heads x 16, RoPE on 8 channels, hidden size 40) for every layer,
    saved as ``kvsieve distill-indexer`` saves them. Their head weights take either sign, so many
    index scores are exactly 0 (every head's ReLU 0) and ties fall on the top-k boundary: both paths
    rank the lower position first."""
    from kvsieve.selectors.dsa.projections import IndexerProjections, save_projections

    torch.manual_seed(3)
    save_projections(str(path), {i: IndexerProjections(40, 4, 16, 8) for i in range(LAYERS)})
    return str(path)


class _Side:
    """One plug-in process's state over its own caches: view, translator, runners."""

    def __init__(self, cfg: SparseAttentionConfig, dtype: torch.dtype, check_state: bool = False) -> None:
        spec = ForeignKVSpec(num_layers=LAYERS, num_blocks=BLOCKS, tokens_per_block=P, num_kv_heads=HKV, head_dim=D,
                             dtype=dtype, device=torch.device("cpu"), layout="vllm-cpu", max_requests=8,
                             max_blocks_per_seq=16)
        self.view = ForeignPagedKV(spec)
        self.raw = [torch.full((BLOCKS, HKV, P, 2 * D), float("nan"), dtype=dtype) for _ in range(LAYERS)]
        for i, raw in enumerate(self.raw):
            self.view.bind_layer(i, raw, *kv_views("vllm-cpu", raw))
        self.translator = StepTranslator(self.view, max_num_tokens=1024, translations=get_backend("torch").required_translations)
        self.geometry = AttentionGeometry(kind="gqa", num_q_heads=HKV * G, num_kv_heads=HKV, head_dim=D,
                                          sm_scale=D ** -0.5)
        plans = lower_plans(PluginConfig(sparse=cfg), num_layers=LAYERS, backend_name="torch")
        check = StateCheck() if check_state else None
        self.runners = [LayerRunner(layer_idx=i, geometry=self.geometry, plan=p, backend=get_backend("torch"),
                                    state_check=check) for i, p in enumerate(plans)]

    def write(self, layer: int, blocks: np.ndarray, offsets: np.ndarray, k: torch.Tensor, v: torch.Tensor) -> None:
        self.view.k_cache(layer)[blocks, :, offsets] = k
        self.view.v_cache(layer)[blocks, :, offsets] = v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("selector", SELECTORS, ids=lambda s: f"{s[0]}-" + "-".join(f"{v}" for v in s[1].values()))
def test_native_decode_equals_the_python_path(tmp_path, selector, dtype):
    _compare_paths(tmp_path, *selector, dtype)


# a per-request budget every row of the steps carries, unlike the process's (SELECTORS' first of each)
PER_REQUEST = [("quest", {"budget": 64, "page_size": 16}, {"budget": 32}),
               ("streaming", {"budget": 48, "num_sink": 4}, {"budget": 24}),
               ("oracle_topk", {"budget": 40}, {"budget": 72}),
               ("block_select", {"block_size": 32, "topk_blocks": 3}, {"topk_blocks": 2}),
               ("dsa", {"index_topk": 48}, {"index_topk": 24})]


@pytest.mark.parametrize("selector", PER_REQUEST, ids=lambda s: s[0])
def test_a_step_of_one_per_request_budget_decodes_natively_as_its_python_path(tmp_path, selector):
    """The native path of :func:`plan_with_setting` (what the CPU backend runs when every row of a
    decode step carries one per-request setting) against the Python path's per-request selection
    (:func:`select_by_setting`) on the same steps: the positions, outputs and pools of the setting.
    In the second run the decode steps alternate between the setting and the process default, two
    bound native paths per layer over the same pools."""
    name, params, knob = selector
    setting = RequestSetting(knob=tuple(sorted(knob.items())))
    process = _compare_paths(tmp_path, name, params, torch.float32)
    per_request = _compare_paths(tmp_path, name, params, torch.float32, settings=[setting] * (1 + DECODES))
    assert any((a != b).any() for a, b in zip(process, per_request)), "the setting's budget is not the process's"
    _compare_paths(tmp_path, name, params, torch.float32, settings=[None, setting, None, setting, setting])


def test_one_setting_names_the_steps_the_native_path_takes():
    b32, b64 = RequestSetting(knob=(("budget", 32),)), RequestSetting(knob=(("budget", 64),))
    dense = RequestSetting(dense=True)
    assert one_setting(None) == (True, None) and one_setting((b32, b32)) == (True, b32)
    for mixed in [(b32, b64), (None, b32), (b32, None), (dense, dense)]:
        assert one_setting(mixed) == (False, None), mixed


def _compare_paths(tmp_path, name: str, params: dict, dtype: torch.dtype,  # noqa: ANN001
                   settings: list[RequestSetting | None] | None = None) -> list[np.ndarray]:
    """Side A runs every step through :class:`LayerRunner`, side B the decode steps through the
    one-call path of the process's plan, or of ``settings[step]``'s when every row of that step
    carries it (``None``: the process default). Returns the positions attended per decode call,
    ``[rows, Hkv]`` each."""
    if name == "dsa":
        params = {**params, "projections": _projections(tmp_path / "indexer.pt")}
    cfg = SparseAttentionConfig(name, params)
    a, b = _Side(cfg, dtype), _Side(cfg, dtype)
    gen = torch.Generator().manual_seed(0)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    # physical blocks: request r holds blocks table[r] (shuffled ids, block 0 unused)
    per = -(-(max(PROMPTS) + DECODES) // P)
    ids = torch.randperm(BLOCKS - 1, generator=gen)[: per * len(PROMPTS)].numpy().astype(np.int32) + 1
    table = ids.reshape(len(PROMPTS), per)
    natives = {}  # (layer, setting) -> the bound one-call path
    lens = np.zeros(len(PROMPTS), dtype=np.int32)
    skipped, calls = False, []
    for step_no in range(1 + DECODES):
        q_lens = np.array(PROMPTS if step_no == 0 else [1] * len(PROMPTS), dtype=np.int32)
        lens += q_lens
        step = VllmStep(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32), lens.copy(), table.copy(),
                        prompt_lens=np.array(PROMPTS, dtype=np.int32),
                        settings=None if settings is None or settings[step_no] is None
                        else (settings[step_no],) * len(PROMPTS))
        setting = None if settings is None else settings[step_no]
        t = int(q_lens.sum())
        pos = np.concatenate([np.arange(n - q, n) for n, q in zip(lens, q_lens)])
        req = np.repeat(np.arange(len(PROMPTS)), q_lens)
        blocks, offsets = table[req, pos // P], pos % P
        for layer in range(LAYERS):
            q, k, v = (torch.randn(t, h, D, generator=gen).to(dtype) for h in (HKV * G, HKV, HKV))
            fed = IndexerInputs(hidden=torch.randn(t, 40, generator=gen).to(dtype)) if name == "dsa" else None
            for side in (a, b):
                side.write(layer, blocks, offsets, k, v)
            outs = []
            for side in (a, b):
                prepared = side.translator.prepare(step)
                md = prepared.metadata
                if side is b and step.decode_only:
                    if (layer, setting) not in natives:
                        k_view, v_view = kv_views("vllm-cpu", b.raw[layer])
                        natives[layer, setting] = decode_layer_path(plan_with_setting(b.runners[layer].plan, setting),
                                                                    b.view, layer, k_view, v_view, b.geometry)
                    assert natives[layer, setting] is not None, "the selector has a native decode program"
                    out = torch.empty_like(q)
                    attended = natives[layer, setting].run(step.block_table, step.seq_lens, step.positions, q, out, fed)
                    outs.append(out)
                    continue
                if side is a and step.decode_only:  # the Python path's selection per (row, KV head); its
                    # on_append writes what forward's writes again (the newest page, this token's index key)
                    params = side.runners[layer].select(q, k, v, md, fed, settings=prepared.row_settings,
                                                        requests_metadata=prepared.requests_metadata)
                    want = token_runs(params, md, side.view).attended
                outs.append(side.runners[layer].forward(q, k, v, prepared, model_inputs=fed).out)
            if step.decode_only:
                np.testing.assert_array_equal(attended, want)
                calls.append(attended)
                skipped |= bool((attended < lens[:, None]).any())
                torch.testing.assert_close(outs[1].float(), outs[0].float(), **tol)
    for pool_name, pools in a.view.aux_pools.items():  # the per-block state both paths keep
        for layer in range(LAYERS):
            valid = np.unique(table)
            torch.testing.assert_close(b.view.aux_pools[pool_name][layer][valid], pools[layer][valid], rtol=0, atol=0)
    assert skipped, "the selector attends fewer positions than the context on some decode row"
    return calls


@pytest.mark.parametrize("selector", SELECTORS, ids=lambda s: f"{s[0]}-" + "-".join(f"{v}" for v in s[1].values()))
def test_a_recomputed_request_selects_its_generated_tokens_as_its_decode_steps_did(tmp_path, selector):
    """vLLM computes a request it preempted again as one prompt of its prompt and generated tokens.
    Side A serves the requests as they first ran (the prompts, then ``DECODES`` one-token steps); side
    B gets the same K/V, queries and hidden states in one recompute step whose rows cross their
    prompt lengths. B's generated tokens must attend what A's decode steps attended (same count per
    (row, KV head), same output), its prompt tokens what A's prompt step attended, and both sides
    must end with the same per-block state (the plug-in's state check on at every step of both, where
    the selector keeps some)."""
    name, params = selector
    if name == "dsa":
        params = {**params, "projections": _projections(tmp_path / "indexer.pt")}
    cfg = SparseAttentionConfig(name, params)
    stateful = name in ("quest", "dsa") or params.get("scoring") == "summary"  # what the state check checks
    a, b = _Side(cfg, torch.float32, check_state=stateful), _Side(cfg, torch.float32, check_state=stateful)
    gen = torch.Generator().manual_seed(1)
    per = -(-(max(PROMPTS) + DECODES) // P)
    table = (torch.randperm(BLOCKS - 1, generator=gen)[: per * len(PROMPTS)].numpy().astype(np.int32) + 1).reshape(
        len(PROMPTS), per)
    prompts = np.array(PROMPTS, dtype=np.int32)
    total = prompts + DECODES
    # every position's q, k, v and hidden state, per layer and request
    data = [[{x: torch.randn(int(n), h, generator=gen) for x, h in (("q", HKV * G * D), ("k", HKV * D),
                                                                    ("v", HKV * D), ("hidden", 40))}
             for n in total] for _ in range(LAYERS)]

    def run(side: _Side, step: VllmStep) -> list[tuple[torch.Tensor, np.ndarray]]:
        q_lens = np.diff(step.query_start_loc)
        pos = np.concatenate([np.arange(n - q, n) for n, q in zip(step.seq_lens, q_lens)])
        req = np.repeat(np.arange(len(PROMPTS)), q_lens)
        got = []
        for layer in range(LAYERS):
            x = {key: torch.cat([data[layer][r][key][n - q: n] for r, (n, q) in enumerate(zip(step.seq_lens, q_lens))])
                 for key in ("q", "k", "v", "hidden")}
            q, k, v = (x[key].view(len(pos), -1, D) for key in ("q", "k", "v"))
            side.write(layer, table[req, pos // P], pos % P, k, v)
            fed = IndexerInputs(hidden=x["hidden"]) if name == "dsa" else None
            prepared = side.translator.prepare(step)
            md = prepared.metadata
            res = side.runners[layer].forward(prepared.to_kvsieve(q), prepared.to_kvsieve(k),
                                              prepared.to_kvsieve(v), prepared,
                                              model_inputs=None if fed is None else IndexerInputs(
                                                  hidden=prepared.to_kvsieve(fed.hidden)))
            out = torch.empty_like(q)
            prepared.to_vllm(res.out, out)
            attended = np.empty((len(pos), HKV), dtype=np.int64)
            attended[prepared.token_order.numpy() if prepared.token_order is not None
                     else np.arange(len(pos))] = res.attended.numpy()
            assert md.num_tokens == len(pos)
            got.append((out, attended))
        return got

    def qsl(q_lens: np.ndarray) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)

    first = [run(a, VllmStep(qsl(prompts), prompts.copy(), table.copy(), prompt_lens=prompts))]
    for i in range(1, DECODES + 1):
        ones = np.ones(len(PROMPTS), dtype=np.int32)
        step = VllmStep(qsl(ones), prompts + i, table.copy(), prompt_lens=prompts)
        assert step.decode_only
        first.append(run(a, step))
    recompute = VllmStep(qsl(total), total.copy(), table.copy(), prompt_lens=prompts)
    assert not recompute.decode_only and recompute.context_tokens.tolist() == list(PROMPTS)
    again = run(b, recompute)
    starts = qsl(total)
    for layer in range(LAYERS):
        for r in range(len(PROMPTS)):
            s = int(starts[r])
            p0 = qsl(prompts)[r]
            out0, att0 = first[0][layer]
            torch.testing.assert_close(again[layer][0][s: s + prompts[r]], out0[p0: p0 + prompts[r]],
                                       rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(again[layer][1][s: s + prompts[r]], att0[p0: p0 + prompts[r]])
            for i in range(DECODES):
                row = s + int(prompts[r]) + i
                out_i, att_i = first[1 + i][layer]
                torch.testing.assert_close(again[layer][0][row], out_i[r], rtol=1e-5, atol=1e-5)
                np.testing.assert_array_equal(again[layer][1][row], att_i[r])
    for pool_name, pools in a.view.aux_pools.items():
        for layer in range(LAYERS):
            valid = np.unique(table)
            torch.testing.assert_close(b.view.aux_pools[pool_name][layer][valid], pools[layer][valid],
                                       rtol=1e-6, atol=1e-6)
