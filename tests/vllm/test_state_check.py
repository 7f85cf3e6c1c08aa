"""The plug-in's per-block state check (``KVSIEVE_CHECK_STATE``, :mod:`kvsieve.integrations.vllm.state_check`)
without vLLM: steps handed to the plug-in's layer runners as vLLM hands them (K/V already in a
vLLM-CPU-layout cache, vLLM's block tables), blocks moving between requests as vLLM moves them.

* with an honest cache the check passes at every step and changes nothing (the pools, the outputs);
* a pool entry corrupted, or a block whose keys change without the plug-in seeing the step that
  wrote them (the stale state a missed rewrite leaves), is a :class:`StateMismatch` naming the
  layer, the request row, the block and the page (Quest) or the slot (DSA);
* the option's parsing and its refusals."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsieve.integrations.vllm.config import PluginConfig, read_plugin_config
from kvsieve.integrations.vllm.layer import LayerRunner
from kvsieve.integrations.vllm.layouts import kv_views
from kvsieve.integrations.vllm.startup import check_plugin_config, lower_plans
from kvsieve.integrations.vllm.state_check import StateCheck, StateMismatch
from kvsieve.integrations.vllm.step import StepTranslator, VllmStep
from kvsieve.selectors.dsa import IndexerInputs
from kvsieve.sparse import AttentionGeometry, SparseAttentionConfig, get_backend
from test_view import BLOCKS, D, G, HIDDEN, HKV, LAYERS, P, _dsa_projections, _foreign, _owner_cache

# (request row -> (blocks, kv_len before, new tokens)) per step, vLLM's block ids: request A's blocks
# 3, 4 are freed after step 1 and handed to request C (block 4 first, so its pages change hands)
STEPS = [{"A": ([3, 4], 0, 40), "B": ([7, 8], 0, 33)},
         {"A": ([3, 4], 40, 1), "B": ([7, 8], 33, 1)},
         {"C": ([4, 3, 9], 0, 70), "B": ([7, 8], 34, 1)},
         {"C": ([4, 3, 9], 70, 1), "B": ([7, 8], 35, 1)}]
QUEST = ("quest", {"budget": 32, "page_size": 16})
DSA = "dsa"
DSA_DECODE_ONLY = "dsa decode-only"  # its prompt steps write index keys without projecting queries


class _Plugin:
    """The plug-in's per-process side on a hand-made vLLM cache: a translator, one runner per layer."""

    def __init__(self, selector: tuple[str, dict] | str, tmp_path, check: bool) -> None:  # noqa: ANN001
        phases = ("generation",) if selector == DSA_DECODE_ONLY else None
        if selector in (DSA, DSA_DECODE_ONLY):
            selector = ("dsa", {"index_topk": 16, "projections": _dsa_projections(tmp_path / "indexer.pt")})
        cfg = PluginConfig(sparse=SparseAttentionConfig(selector[0], selector[1], phases=phases), check_state=check)
        self.view = _foreign()
        self.raw = [_owner_cache("vllm-cpu") for _ in range(LAYERS)]
        for i in range(LAYERS):
            self.view.bind_layer(i, self.raw[i], *kv_views("vllm-cpu", self.raw[i]))
        self.translator = StepTranslator(self.view, max_num_tokens=256, translations=tuple(
            get_backend("torch").required_translations))
        geometry = AttentionGeometry(kind="gqa", num_q_heads=HKV * G, num_kv_heads=HKV, head_dim=D, sm_scale=D ** -0.5)
        self.checker = StateCheck() if check else None
        self.runners = [LayerRunner(layer_idx=i, geometry=geometry, plan=p, backend=get_backend("torch"),
                                    state_check=self.checker)
                        for i, p in enumerate(lower_plans(cfg, num_layers=LAYERS, backend_name="torch"))]
        self.reads_hidden = selector[0] == "dsa"

    def step(self, rows: dict, gen: torch.Generator) -> list[torch.Tensor]:
        """One vLLM step: write the new tokens' K/V where vLLM would, then every layer -> outputs."""
        blocks = [b for b, _, _ in rows.values()]
        before = np.array([n for _, n, _ in rows.values()])
        new = np.array([t for _, _, t in rows.values()])
        table = np.zeros((len(rows), 4), dtype=np.int32)
        for i, b in enumerate(blocks):
            table[i, : len(b)] = b
        # every row with more than one new token is a prompt, every other one decodes
        prompts = np.where(new > 1, before + new, before).astype(np.int32)
        step = VllmStep(np.concatenate([[0], np.cumsum(new)]).astype(np.int32), (before + new).astype(np.int32), table,
                        prompt_lens=prompts)
        t = int(new.sum())
        outs = []
        for layer in range(LAYERS):
            q, k, v = (torch.randn(t, h, D, generator=gen) for h in (HKV * G, HKV, HKV))
            tok = 0
            for i in range(len(rows)):
                pos = np.arange(before[i], before[i] + new[i])
                blk = torch.from_numpy(table[i, pos // P].astype(np.int64))
                off = torch.from_numpy(pos % P)
                self.view.k_cache(layer)[blk, :, off] = k[tok: tok + new[i]]
                self.view.v_cache(layer)[blk, :, off] = v[tok: tok + new[i]]
                tok += new[i]
            hidden = torch.randn(t, HIDDEN, generator=gen) if self.reads_hidden else None
            tr = self.translator.prepare(step)
            fed = None if hidden is None else IndexerInputs(hidden=tr.to_kvsieve(hidden))
            res = self.runners[layer].forward(tr.to_kvsieve(q), tr.to_kvsieve(k), tr.to_kvsieve(v), tr,
                                              model_inputs=fed)
            outs.append(res.out)
        return outs

    def pools(self) -> dict[str, list[torch.Tensor]]:
        return {name: [p.clone() for p in pools] for name, pools in self.view.aux_pools.items()}


@pytest.mark.parametrize("selector", [QUEST, DSA, DSA_DECODE_ONLY], ids=["quest", "dsa", "dsa-decode-only"])
def test_check_passes_and_changes_nothing_while_blocks_change_hands(selector, tmp_path):
    on, off = _Plugin(selector, tmp_path, True), _Plugin(selector, tmp_path, False)
    gen_on, gen_off = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    for rows in STEPS:
        out_on, out_off = on.step(rows, gen_on), off.step(rows, gen_off)
        for a, b in zip(out_on, out_off):
            assert torch.equal(a, b)
        assert on.pools().keys() == off.pools().keys() and on.pools()
        for name, pools in on.pools().items():
            assert all(torch.equal(a, b) for a, b in zip(pools, off.pools()[name]))


def _corrupt_then_step(plugin: _Plugin, corrupt, upto: int = 3) -> str:  # noqa: ANN001
    gen = torch.Generator().manual_seed(0)
    for rows in STEPS[:upto]:
        plugin.step(rows, gen)
    corrupt()
    with pytest.raises(StateMismatch) as err:
        plugin.step(STEPS[upto], gen)
    return str(err.value)


def test_corrupted_page_summary_is_named(tmp_path):
    plugin = _Plugin(QUEST, tmp_path, True)
    pool = next(iter(plugin.view.aux_pools.values())) if plugin.view.aux_pools else None

    def corrupt() -> None:  # request C's page 2 = block 3's first 16-token page (page 0 of block 3), layer 0
        pools = next(iter(plugin.view.aux_pools.values()))
        pools[0][3, 1, 0, 1, 5] += 1.0  # head 1, max, channel 5

    assert pool is None  # the pools are made at the first step
    msg = _corrupt_then_step(plugin, corrupt)
    for part in ("layer 0", "'quest'", "request row 0", "block 3", "page 2 of the request", "page 0 of the block",
                 "head 1, max, channel 5"):
        assert part in msg, (part, msg)


def test_keys_changed_behind_the_plugins_back_are_named(tmp_path):
    """A block whose keys change in vLLM's cache without the plug-in's hooks seeing the step (what a
    block handed to another request with its summaries left stale looks like): caught at the next
    step that reads the block."""
    plugin = _Plugin(QUEST, tmp_path, True)

    def rewrite() -> None:  # new keys in block 4 (request C's first block), layer 1, outside any step
        plugin.view.k_cache(1)[4, :, :6] = torch.randn(HKV, 6, D, generator=torch.Generator().manual_seed(1))

    msg = _corrupt_then_step(plugin, rewrite)
    assert "layer 1" in msg and "block 4" in msg and "page 0 of the request" in msg, msg


def test_corrupted_index_key_is_named(tmp_path):
    plugin = _Plugin(DSA, tmp_path, True)

    def corrupt() -> None:  # request B's position 20: block 7, slot 20, layer 1
        plugin.view.aux_pools["dsa_index_k"][1][7, 20, 3] += 1.0

    msg = _corrupt_then_step(plugin, corrupt)
    for part in ("layer 1", "'dsa'", "request row 1", "position 20", "block 7", "slot 20", "as verified when written"):
        assert part in msg, (part, msg)


def test_index_keys_never_written_are_named(tmp_path):
    """A request holding positions whose keys the plug-in never computed (its K/V written without the
    plug-in's step) is refused by name."""
    plugin = _Plugin(DSA, tmp_path, True)
    gen = torch.Generator().manual_seed(0)
    plugin.step(STEPS[0], gen)
    with pytest.raises(StateMismatch, match=r"layer 0.*block 9, slot 0 .*never written"):
        plugin.step({"D": ([9], 5, 1)}, gen)  # 5 positions in block 9 no step of the plug-in wrote


def test_option_parsing_and_refusals(tmp_path):
    assert read_plugin_config({"KVSIEVE_SELECTOR": "quest", "KVSIEVE_CHECK_STATE": "1"}).check_state
    assert not read_plugin_config({"KVSIEVE_SELECTOR": "quest", "KVSIEVE_CHECK_STATE": "false"}).check_state
    assert not read_plugin_config({"KVSIEVE_SELECTOR": "quest"}).check_state
    with pytest.raises(ValueError, match="KVSIEVE_CHECK_STATE='yes please': give 1, true, 0 or false"):
        read_plugin_config({"KVSIEVE_SELECTOR": "quest", "KVSIEVE_CHECK_STATE": "yes please"})
    path = tmp_path / "c.yaml"
    path.write_text("selector: quest\ncheck_state: true\n")
    assert read_plugin_config({"KVSIEVE_CONFIG": str(path)}).check_state
    with pytest.raises(ValueError, match="contradicts check_state: True"):
        read_plugin_config({"KVSIEVE_CONFIG": str(path), "KVSIEVE_CHECK_STATE": "0"})
    path.write_text("selector: quest\ncheck_state: 1\n")
    with pytest.raises(ValueError, match="check_state must be true or false, got 1"):
        read_plugin_config({"KVSIEVE_CONFIG": str(path)})
    for spec, message in [("dense", "'dense' runs no selector"), ("streaming", "'streaming' keeps no per-block"),
                          ("block_select", "scoring='exact' keeps no per-block state")]:
        with pytest.raises(ValueError, match=message):
            check_plugin_config(read_plugin_config({"KVSIEVE_SELECTOR": spec, "KVSIEVE_CHECK_STATE": "1"}),
                                device="cpu")
    check_plugin_config(read_plugin_config({"KVSIEVE_SELECTOR": "block_select:scoring=summary",
                                            "KVSIEVE_CHECK_STATE": "1"}), device="cpu")
    assert BLOCKS > 9  # the steps' block ids exist
