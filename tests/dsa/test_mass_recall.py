"""The selection rules of ``kvsieve.eval.mass_recall`` against the selectors themselves, run
through kvsieve's Engine (``recall_table.run_selector``; ``dsa`` through a layer fed
``IndexerInputs``): the same positions, decode step by decode step and KV head."""
from __future__ import annotations

import pytest
import torch

from kvsieve import Engine, KVCacheManager, KVCacheSpec, SparseAttention, SparseAttentionConfig, lower_config
from kvsieve.eval.mass_recall import group_mass, mean_interval, select, window_recall
from kvsieve.selectors import IndexerInputs
from kvsieve.selectors.dsa.projections import IndexerProjections
from recall_table import make_input, run_selector

BUDGET = 64
ENGINE_PARAMS = {
    "oracle_topk": ("oracle_topk", {"budget": BUDGET}),
    "oracle_page": ("oracle_topk", {"budget": BUDGET, "block_size": 16}),
    "quest": ("quest", {"budget": BUDGET, "page_size": 16, "summary_dtype": "bfloat16"}),
    "block_select": ("block_select", {"block_size": 16, "topk_blocks": BUDGET // 16, "init_blocks": 0,
                                      "local_blocks": 1, "score_type": "max", "scoring": "summary"}),
    "streaming": ("streaming", {"budget": BUDGET, "num_sink": 4}),
}


@pytest.fixture(scope="module")
def data():
    return make_input(prompt_len=300, decode_steps=3, num_kv_heads=2, group_size=3, head_dim=32, seed=1)


@pytest.mark.parametrize("name", list(ENGINE_PARAMS))
def test_rule_selects_what_the_selector_selects(data, name):
    selector, params = ENGINE_PARAMS[name]
    got = run_selector(selector, params, data)
    keys = torch.cat([data.k, data.dk])
    for s in range(data.dq.shape[0]):
        mine = select(name, data.dq[s], keys[: data.prompt_len + s + 1], data.k.shape[2] ** -0.5, BUDGET)
        assert [set(m.tolist()) for m in mine] == got.selected[s], (name, s)


def test_dsa_rule_selects_what_the_selector_selects():
    """Prefill 200 tokens and decode one through a dsa layer (bf16 index keys) fed hidden states;
    the decode row's selection equals the top-k of the rule's index scores."""
    torch.manual_seed(0)
    n, hid, topk = 201, 48, 40
    proj = IndexerProjections(hid, 4, 16, 8)
    hidden = torch.randn(n, hid)
    spec = KVCacheSpec(num_layers=1, num_blocks=20, tokens_per_block=16, num_kv_heads=2, head_dim=16,
                       max_requests=1, max_blocks_per_seq=16)
    plan = lower_config(SparseAttentionConfig("dsa", dict(index_topk=topk, n_heads=4, head_dim=16, rope_dim=8,
                                                           index_k_dtype="bfloat16")), num_layers=1)[0]
    plan.selector.set_projections({0: proj})
    layer = SparseAttention(layer_idx=0, num_q_heads=4, num_kv_heads=2, head_dim=16, plan=plan)
    engine = Engine(KVCacheManager(spec), [layer], max_num_requests=1, max_num_tokens=256)
    q, k, v = torch.randn(n, 4, 16), torch.randn(n, 2, 16), torch.randn(n, 2, 16)
    for rows, ctx in ((slice(0, n - 1), 1), (slice(n - 1, n), 0)):
        md = engine.begin_step([0], [rows.stop - rows.start], ctx)
        params = layer.forward(q[rows], k[rows], v[rows], md, model_inputs=IndexerInputs(hidden=hidden[rows])).params
        engine.end_step()
    idx, off = params.sparse_attn_indices, params.sparse_attn_offsets
    chosen = {int(x) for x in idx[0, off[0]:off[1]] if x >= 0}
    from kvsieve.sparse.prepare import LayerCapture

    cap = LayerCapture(hidden, q[n - 1:], k, 0.25)
    with torch.no_grad():
        kk = proj.keys(hidden, torch.arange(n)).bfloat16().float()
        qq, w = proj.queries(hidden[n - 1:], torch.tensor([n - 1]))
        scores = torch.einsum("rh,rhs->rs", w, torch.einsum("rhd,sd->rhs", qq, kk).relu())[0]
    (mine, _) = select("dsa", cap.q[0], k, cap.scale, topk, index_scores=scores)
    assert set(mine.tolist()) == chosen
    # and window_recall scores the same choice: its mass equals the hand sum of the dense mass
    out = window_recall({0: cap}, torch.tensor([n - 1]), (n // topk,), {0: proj}, n)
    mass = group_mass(cap.q[0], k, cap.scale)
    want = sum(float(mass[h, sorted(mine.tolist())].sum()) for h in range(2)) / 2
    assert out["dsa"][n // topk][0] == pytest.approx(want, rel=1e-5)


def test_refusals_and_interval():
    q, k = torch.randn(2, 8), torch.randn(40, 1, 8)
    with pytest.raises(ValueError, match="'dsa' needs index_scores"):
        select("dsa", q, k, 0.3, 16)
    with pytest.raises(ValueError, match="unknown selector 'quset'"):
        select("quset", q, k, 0.3, 16)
    with pytest.raises(ValueError, match="needs at least 2 values, got 1"):
        mean_interval([0.5])
    mean, half = mean_interval([0.4, 0.6])  # t(1) = 12.706, sd = 0.1414, n = 2
    assert mean == pytest.approx(0.5) and half == pytest.approx(12.706 * 0.141421356 / 2 ** 0.5, rel=1e-4)


def test_bound_terms_split_the_bound_exactly_and_rank_a_planted_page():
    """center + spread is Quest's bound (checked against _page_bounds' fp32 bound); a page whose
    keys align with the query gets the top mass and the bound's top page."""
    from kvsieve.eval.mass_recall import _page_bounds, bound_terms

    torch.manual_seed(0)
    q, k = torch.randn(2, 8), torch.randn(64, 1, 8) * 0.1
    k[16:32] += 2 * q[0] / q[0].norm()
    bound = _page_bounds(q, k, 16, torch.float32)[0]  # [G, pages]
    kp = k.view(4, 16, 1, 8)
    c, h = (kp.amax(1) + kp.amin(1)) / 2, (kp.amax(1) - kp.amin(1)) / 2
    torch.testing.assert_close(bound, (c[:, 0] @ q.T + h[:, 0] @ q.abs().T).T)
    terms = bound_terms(q, k, 1.0, 16, density=4)
    assert terms["top_overlap"] == 1.0 and terms["rho_bound"] > 0


def test_command_on_tiny_random_measures_and_reuses_its_captures(tmp_path):
    import json

    from kvsieve.eval.mass_recall import main

    args = ["--model", "tiny-random", "--length", "256", "--texts", "2", "--rows", "2", "--densities", "4", "16",
            "--captures", str(tmp_path / "caps")]
    lines: list[str] = []
    assert main(args + ["--json", str(tmp_path / "a.json")], lines.append) == 0
    assert len(list((tmp_path / "caps").glob("*.pt"))) == 2
    assert any(line.startswith("| oracle_topk | ") for line in lines)
    assert main(args + ["--json", str(tmp_path / "b.json")], lines.append) == 0
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert a["per_window"] == b["per_window"]
    for window in a["per_window"]:
        for d in ("4", "16"):
            ceiling = window["oracle_topk"][d]
            assert all(window[n][d][layer] <= ceiling[layer] + 1e-6 for n in window for layer in ceiling)
