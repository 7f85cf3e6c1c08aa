"""Sparsity per request without vLLM (main suite): what a request may ask and what is refused by
name, the batch-index table kept from vLLM's batch updates, and one layer running rows of several
settings in one step against the same layer run with each setting as the process default."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsieve.integrations.vllm.config import PluginConfig, parse_selector_spec
from kvsieve.integrations.vllm.layer import LayerRunner
from kvsieve.integrations.vllm.layouts import kv_views
from kvsieve.integrations.vllm.request_settings import BatchRows, RequestSetting, parse_request_setting
from kvsieve.integrations.vllm.startup import lower_plans
from kvsieve.integrations.vllm.step import StepTranslator, VllmStep
from kvsieve.metadata.foreign_paged import ForeignKVSpec, ForeignPagedKV
from kvsieve.sparse import AttentionGeometry, get_backend

QUEST = PluginConfig(sparse=parse_selector_spec("quest:budget=64,page_size=16,summary_dtype=float32"),
                     source="KVSIEVE_SELECTOR=quest:budget=64,page_size=16")
BUDGET_32 = RequestSetting(knob=(("budget", 32),))


@pytest.mark.parametrize("raw,expected", [
    ({"budget": 32}, BUDGET_32), ("budget=32", BUDGET_32), (" budget = 32 ", BUDGET_32),
    ("budget=64", None),  # the process default is the default
    ({"dense": True}, RequestSetting(dense=True)), ("dense=true", RequestSetting(dense=True)),
    ({"dense": False}, None), ({}, None),
])
def test_request_settings_honoured(raw, expected):
    assert parse_request_setting(raw, QUEST) == expected


@pytest.mark.parametrize("raw,message", [
    ("budget=8", r"field 'budget': quest.budget: a budget of 8 tokens is not a whole number \(>= 1\) of units of 16"),
    ("budget=0", "field 'budget'.*not a whole number"),
    ("budget=40", "give a multiple of 16"),
    ("budget=abc", "field 'budget' must be a whole number of tokens, got 'abc'"),
    ({"budget": True}, "field 'budget' must be a whole number of tokens"),
    ("page_size=32", "field 'page_size' is a field of selector 'quest' fixed for the process"),
    ("index_topk=64", "field 'index_topk' is not a per-request field of the process's selector"),
    ("sparsity=0.5", "field 'sparsity' \\(a density\\) is not taken per request"),
    ("budget", "parameter 'budget' must look like key=value"),
    ("budget=32,budget=48", "parameter 'budget' given twice"),
    ("dense=yes please", "field 'dense' must be true or false"),
    ("dense=true,budget=32", "fields 'dense' and 'budget' contradict each other"),
    (17, "give a mapping or a string like 'budget=256', got int"),
])
def test_request_settings_refused_by_name(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_request_setting(raw, QUEST)


def test_request_settings_refused_without_a_selector():
    with pytest.raises(ValueError, match="plug-in is not enabled"):
        parse_request_setting("budget=32", None)
    dense = PluginConfig(sparse=None, source="KVSIEVE_SELECTOR=dense")
    with pytest.raises(ValueError, match="field 'budget' needs a selector, but the process serves dense"):
        parse_request_setting("budget=32", dense)
    assert parse_request_setting("dense=true", dense) is None
    hints = PluginConfig(sparse=parse_selector_spec("skip_softmax"), source="KVSIEVE_SELECTOR=skip_softmax")
    with pytest.raises(ValueError, match="no budget in tokens to set per request"):
        parse_request_setting("budget=32", hints)


def test_settings_under_a_selector_selecting_in_the_prompt_need_a_declaration(tmp_path):
    """Under DSA (selects in the prompt) a request's setting changes its prompt's K/V, which vLLM's
    prefix cache would share with other settings' requests: refused at admission unless the process
    declares that its prefix cache keeps settings apart (KVSIEVE_PROMPT_SETTINGS)."""
    from kvsieve.integrations.vllm.config import read_plugin_config, selects_in_prompt

    from kvsieve.selectors.dsa.projections import IndexerProjections, save_projections

    save_projections(str(tmp_path / "x.pt"), {i: IndexerProjections(40, 4, 16, 8) for i in range(2)})
    spec = f"dsa:projections={tmp_path / 'x.pt'},index_topk=64"
    dsa = PluginConfig(sparse=parse_selector_spec(spec), source=f"KVSIEVE_SELECTOR={spec}")
    assert selects_in_prompt(dsa.sparse) and not selects_in_prompt(QUEST.sparse) and not selects_in_prompt(None)
    for raw in ("budget=32", "dense=true"):
        with pytest.raises(ValueError, match="selects in the prompt.*cache_salt per setting.*KVSIEVE_PROMPT_SETTINGS=1"):
            parse_request_setting(raw, dsa)
    assert parse_request_setting("budget=64", dsa) is None  # the process default
    env = {"KVSIEVE_SELECTOR": spec, "KVSIEVE_PROMPT_SETTINGS": "1"}
    opted = read_plugin_config(env)
    assert opted.prompt_settings
    assert parse_request_setting("budget=32", opted) == RequestSetting(knob=(("index_topk", 32),))
    decode_only = tmp_path / "plan.yaml"
    decode_only.write_text(f"selector: dsa\nparams: {{projections: {tmp_path / 'x.pt'}, index_topk: 64}}\n"
                           "phases: [generation]\n")
    assert not selects_in_prompt(read_plugin_config({"KVSIEVE_CONFIG": str(decode_only)}).sparse)
    assert parse_request_setting("budget=32", read_plugin_config({"KVSIEVE_CONFIG": str(decode_only)})) is not None
    with pytest.raises(ValueError, match="KVSIEVE_PROMPT_SETTINGS='yes': give 1, true, 0 or false"):
        read_plugin_config({**env, "KVSIEVE_PROMPT_SETTINGS": "yes"})


def test_worker_state_refuses_speculative_decoding_and_prompt_embeddings():
    """vLLM's own speculative methods verify drafts in multi-token rows the selector would select
    as prompt chunks (kvsieve's drafter is test_drafter.py's); a prompt given as embeddings carries no token ids, so its prompt length is not
    known: the worker's state refuses both at start-up, by name."""
    from types import SimpleNamespace

    from kvsieve.integrations.vllm.state import PluginState

    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=256, hf_config=SimpleNamespace(num_hidden_layers=2)),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=256),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1),
        speculative_config=None)
    assert PluginState(QUEST, vllm_config, torch.device("cpu")).plans[0] is not None
    vllm_config.speculative_config = SimpleNamespace(method="ngram", model="ngram", num_speculative_tokens=2)
    with pytest.raises(NotImplementedError, match=r"method 'ngram' \(speculative_config.method\) is not supported"):
        PluginState(QUEST, vllm_config, torch.device("cpu"))
    vllm_config.speculative_config = None
    vllm_config.model_config.enable_prompt_embeds = True
    with pytest.raises(NotImplementedError, match="enable_prompt_embeds is not supported"):
        PluginState(QUEST, vllm_config, torch.device("cpu"))


def test_batch_rows_follow_removals_additions_and_moves():
    table, a, b = BatchRows(), BUDGET_32, RequestSetting(dense=True)
    assert table.settings(3) is None
    with pytest.raises(RuntimeError, match=r"rows \[0\] of a 1-row step have no prompt length"):
        table.prompt_lens(1)  # an empty table: a step that asks holds requests (vLLM's dummy steps never ask)
    table.update([], [(0, a, 10), (1, None, 11), (2, b, 12)], [])
    assert table.settings(3) == (a, None, b) and table.prompt_lens(3).tolist() == [10, 11, 12]
    table.update([0], [], [(2, 0, False)])  # condense: the last row moves into the hole
    assert table.settings(2) == (b, None) and table.prompt_lens(2).tolist() == [12, 11]
    with pytest.raises(RuntimeError, match=r"rows \[2\] of a 3-row step have no prompt length"):
        table.prompt_lens(3)  # row 2 is empty now
    table.update([], [(2, a, 20)], [(0, 2, True)])  # a new row, then a swap
    assert table.settings(3) == (a, None, b) and table.prompt_lens(3).tolist() == [20, 11, 12]
    table.update([], [(0, None, 30)], [])  # a new request at a used index replaces its setting and length
    assert table.settings(3) == (None, None, b) and table.settings(2) is None
    assert table.prompt_lens(3).tolist() == [30, 11, 12]
    table.update([], [(1, None, None)], [])  # a prompt without token ids: its length is not known
    with pytest.raises(RuntimeError, match=r"rows \[1\] of a 3-row step"):
        table.prompt_lens(3)
    assert table.prompt_lens(1).tolist() == [30]
    table.update([0, 1, 2], [], [])  # every request gone: a step asking now missed the batch's updates
    with pytest.raises(RuntimeError, match=r"rows \[0, 1\] of a 2-row step.*KvsieveRequestSettings"):
        table.prompt_lens(2)


def test_a_process_without_the_batch_table_refuses_to_read_prompt_lengths(monkeypatch):
    from kvsieve.integrations.vllm import request_settings

    monkeypatch.setattr(request_settings, "_CURRENT", [None])
    with pytest.raises(RuntimeError, match="did not build kvsieve's logits processor"):
        request_settings.row_prompt_lens(1)
    request_settings.batch_rows().update([], [(0, None, 7)], [])
    assert request_settings.row_prompt_lens(1).tolist() == [7]


def test_a_step_of_unknown_prompt_lengths_is_refused_and_vllm_dummy_steps_are_served(monkeypatch):
    """vLLM 0.32's dummy steps (its profile and warm-up runs, ``_dummy_run``) build no attention
    metadata: the router recognises them as such and serves them without asking any prompt length,
    even in a process without the batch table. A real step whose rows the table does not know (never
    added, or every update missed) is refused by name with the remedy, before it is translated: the
    table and the translator's prepared step are left as they were."""
    from kvsieve.integrations.vllm import request_settings
    from kvsieve.integrations.vllm.router import DUMMY_STEP, route_call

    def never(*args):  # noqa: ANN002
        raise AssertionError("a dummy step asked for its rows")

    monkeypatch.setattr(request_settings, "_CURRENT", [None])
    assert route_call(has_metadata=False, host_whole=False, decode_step=never, one_call=never).path == DUMMY_STEP
    table = request_settings.batch_rows()
    assert route_call(has_metadata=False, host_whole=False, decode_step=never, one_call=never).path == DUMMY_STEP
    with pytest.raises(RuntimeError, match=r"rows \[0, 1\] of a 2-row step have no prompt length.*"
                                           r"VLLM_USE_V2_MODEL_RUNNER=0.*unset KVSIEVE_SELECTOR"):
        request_settings.row_prompt_lens(2)
    table.update([], [(0, None, 40)], [])
    raw = torch.zeros(BLOCKS, HKV, P, 2 * D)
    spec = ForeignKVSpec(num_layers=1, num_blocks=BLOCKS, tokens_per_block=P, num_kv_heads=HKV, head_dim=D,
                         dtype=torch.float32, device=torch.device("cpu"), layout="vllm-cpu", max_requests=8,
                         max_blocks_per_seq=16)
    view = ForeignPagedKV(spec)
    view.bind_layer(0, raw, *kv_views("vllm-cpu", raw))
    translator = StepTranslator(view, max_num_tokens=64, translations=get_backend("torch").required_translations)
    blocks = np.array([[3, 5, 7]], dtype=np.int32)
    step = VllmStep(np.array([0, 40], dtype=np.int32), np.array([40], dtype=np.int32), blocks,
                    prompt_lens=request_settings.row_prompt_lens(1))
    prepared = translator.prepare(step)
    with pytest.raises(RuntimeError, match=r"rows \[1\] of a 2-row step have no prompt length"):
        request_settings.row_prompt_lens(2)  # row 1 was never added
    assert request_settings.row_prompt_lens(1).tolist() == [40] and table.settings(2) is None
    assert translator.prepare(step) is prepared and prepared.metadata.num_contexts == 1
    assert view.valid_lens[prepared.metadata.slots[0]] == 40


HKV, G, D, P, BLOCKS, HIDDEN = 2, 2, 32, 16, 96, 48
# per step: (request, query tokens), in vLLM's order (decode rows first, a new prompt mixed in)
STEPS = [((0, 1, 2, 3), (100, 80, 60, 90)), ((3, 1, 0, 2), (1, 1, 1, 1)), ((2, 0, 4, 1, 3), (1, 1, 50, 1, 1)),
         ((0, 1, 2, 3, 4), (1, 1, 1, 1, 1)), ((4, 3, 2, 1, 0), (1, 1, 1, 1, 1))]
DENSE = RequestSetting(dense=True)
# (process selector, its budget in tokens, the budget knob's unit in tokens, the settings of requests 0-4):
# Quest selects decode rows only; DSA (fed each token's hidden state) selects prompt rows too, so a dense
# request's prompt rows sit beside selecting ones and list every position
CASES = {
    "quest": ("quest:budget=64,page_size=16,summary_dtype=float32", 64, P,
              {0: None, 1: BUDGET_32, 2: DENSE, 3: BUDGET_32, 4: RequestSetting(knob=(("budget", 48),))}),
    "dsa": ("dsa:index_topk=24,index_k_dtype=float32", 24, 1, {0: RequestSetting(knob=(("index_topk", 12),)), 1: None, 2: DENSE,
                                         3: RequestSetting(knob=(("index_topk", 40),)),
                                         4: RequestSetting(knob=(("index_topk", 12),))}),
}


class _Side:
    """One layer over its own view of the shared raw cache: ``settings`` on (the rows' per-request
    settings) or off (every row the process default of ``config``)."""

    def __init__(self, config: PluginConfig, raw: torch.Tensor, per_request: bool) -> None:
        spec = ForeignKVSpec(num_layers=1, num_blocks=BLOCKS, tokens_per_block=P, num_kv_heads=HKV, head_dim=D,
                             dtype=torch.float32, device=torch.device("cpu"), layout="vllm-cpu", max_requests=8,
                             max_blocks_per_seq=16)
        view = ForeignPagedKV(spec)
        view.bind_layer(0, raw, *kv_views("vllm-cpu", raw))
        self.translator = StepTranslator(view, max_num_tokens=512, translations=tuple(
            get_backend("torch").required_translations))
        geometry = AttentionGeometry(kind="gqa", num_q_heads=HKV * G, num_kv_heads=HKV, head_dim=D, sm_scale=D ** -.5)
        plan = lower_plans(config, num_layers=1, backend_name="torch")[0]
        self.reads_hidden = plan is not None and plan.selector.model_inputs_type is not None
        self.runner = LayerRunner(layer_idx=0, geometry=geometry, plan=plan, backend=get_backend("torch"))
        self.per_request = per_request

    def forward(self, step: VllmStep, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM-ordered q/k/v (and ``hidden [T, HIDDEN]``, fed to a selector reading it) -> (out,
        attended per token row summed over the KV heads), vLLM's order."""
        from kvsieve.selectors.dsa import IndexerInputs

        tr = self.translator.prepare(step if self.per_request else VllmStep(
            step.query_start_loc, step.seq_lens, step.block_table, step.prompt_lens))
        fed = IndexerInputs(hidden=tr.to_kvsieve(hidden)) if self.reads_hidden else None
        res = self.runner.forward(tr.to_kvsieve(q), tr.to_kvsieve(k), tr.to_kvsieve(v), tr, model_inputs=fed)
        out, attended = torch.empty_like(res.out), torch.empty(q.shape[0], dtype=torch.int64)
        tr.to_vllm(res.out, out)
        tr.to_vllm(res.attended.sum(1), attended)
        return out, attended


def _config_of(spec: str, setting: RequestSetting | None) -> PluginConfig:
    if setting is not None and setting.dense:
        return PluginConfig(sparse=None)
    sparse = parse_selector_spec(spec)
    sparse.params.update(dict(setting.knob) if setting is not None else {})
    return PluginConfig(sparse=sparse)


@pytest.mark.parametrize("case", list(CASES))
def test_rows_of_several_settings_equal_each_setting_run_as_the_process_default(case, tmp_path):
    """In the same steps requests ask the process default, two other budgets and dense (a prompt
    arriving mid-decode too). Every request's rows equal the same layer run with its setting as the
    process default (fp32, 1e-5; the same positions read), and decode rows past their budget read
    what it allows (dense rows every position)."""
    from kvsieve.selectors.dsa.projections import IndexerProjections, save_projections

    spec, default_budget, unit, settings = CASES[case]
    if case == "dsa":  # random index projections (8 heads x 16, RoPE on 8 channels), as distill-indexer saves them;
        # with fewer heads many index logits are exactly 0 (every head's ReLU off), and a top-k among such ties
        # may pick differently in batches of other shapes
        torch.manual_seed(3)
        save_projections(str(tmp_path / "indexer.pt"), {0: IndexerProjections(HIDDEN, 8, 16, 8)})
        spec += f",projections={tmp_path / 'indexer.pt'}"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        raw = torch.full((BLOCKS, HKV, P, 2 * D), float("nan"))
        k_view, v_view = kv_views("vllm-cpu", raw)
        mixed = _Side(PluginConfig(sparse=parse_selector_spec(spec)), raw, per_request=True)
        alone = {s: _Side(_config_of(spec, s), raw, per_request=False) for s in set(settings.values())}
        blocks = {r: list(np.random.default_rng(r).permutation(np.arange(1 + 16 * r, 17 + 16 * r))) for r in settings}
        lens = dict.fromkeys(settings, 0)
        checked = set()
        for rids, qlens in STEPS:
            t = sum(qlens)
            q, k, v = (torch.randn(t, h, D, generator=gen) for h in (HKV * G, HKV, HKV))
            hidden = torch.randn(t, HIDDEN, generator=gen)
            rows = np.repeat(np.arange(len(rids)), qlens)
            for j, r in enumerate(rids):  # this step's K/V into each request's blocks (vLLM wrote them)
                pos = np.arange(lens[r], lens[r] + qlens[j])
                blk = np.array(blocks[r])[pos // P]
                k_view[blk, :, pos % P] = k[rows == j]
                v_view[blk, :, pos % P] = v[rows == j]
                lens[r] += qlens[j]
            table = np.zeros((len(rids), 16), dtype=np.int32)
            for j, r in enumerate(rids):
                table[j] = blocks[r]
            kv_lens = np.array([lens[r] for r in rids], dtype=np.int32)
            step = VllmStep(np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32), kv_lens, table,
                            # a row of several tokens is a prompt, a row of one decodes
                            prompt_lens=np.where(np.array(qlens) > 1, kv_lens, kv_lens - 1).astype(np.int32),
                            settings=tuple(settings[r] for r in rids))
            got, attended = mixed.forward(step, q, k, v, hidden)
            for s, side in alone.items():
                want, want_attended = side.forward(step, q, k, v, hidden)
                for j, r in enumerate(rids):
                    if settings[r] == s:
                        torch.testing.assert_close(got[rows == j], want[rows == j], rtol=1e-5, atol=1e-5)
                        assert torch.equal(attended[rows == j], want_attended[rows == j])
                        checked.add((r, qlens[j] == 1))
            for j, r in enumerate(rids):  # decode rows past their budget: at most what it allows
                setting, kv_len = settings[r], lens[r]
                budget = default_budget if setting is None else dict(setting.knob).get("budget", dict(
                    setting.knob).get("index_topk"))
                if qlens[j] > 1 or (budget is not None and kv_len <= budget):
                    continue
                got_attended = int(attended[rows == j].sum())  # summed over the KV heads
                if setting is not None and setting.dense:
                    assert got_attended == HKV * kv_len, r
                else:
                    assert HKV * (budget - unit) < got_attended <= HKV * budget, (r, setting, got_attended)
        assert checked == {(r, d) for r in settings for d in (False, True)}  # every request, prompt and decode
    finally:
        torch.set_num_threads(threads)
