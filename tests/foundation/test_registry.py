"""Registry: built-ins, the entry-point path through a real installed distribution, config checks."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import kvsieve
from kvsieve import Engine, KVCacheManager, KVCacheSpec, SparseAttention, SparseAttentionConfig, lower_config
from kvsieve.sparse import registry

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kvsieve_example_selector"


@pytest.fixture
def installed_example(tmp_path, monkeypatch):
    """A real distribution on sys.path: the example's sources plus a .dist-info with entry_points.txt."""
    site = tmp_path / "site"
    shutil.copytree(EXAMPLE / "src" / "kvsieve_example_selector", site / "kvsieve_example_selector")
    info = site / "kvsieve_example_selector-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvsieve-example-selector\nVersion: 0.1.0\n")
    pyproject = (EXAMPLE / "pyproject.toml").read_text()
    line = next(x for x in pyproject.splitlines() if x.startswith("recent_blocks"))
    (info / "entry_points.txt").write_text("[kvsieve.selectors]\n" + line.replace('"', "") + "\n")
    monkeypatch.syspath_prepend(str(site))
    yield
    registry.SELECTORS._classes.pop("recent_blocks", None)


def test_builtins_are_registered():
    assert {"streaming", "oracle_topk"} <= set(kvsieve.available_selectors())


def test_unknown_name_lists_known_ones():
    with pytest.raises(ValueError, match=r"unknown selector 'nope'; known selectors: \[.*streaming"):
        kvsieve.create_selector("nope")


def test_entry_point_selector_is_found_and_runs(installed_example):
    assert "recent_blocks" in kvsieve.available_selectors()
    sel = kvsieve.create_selector("recent_blocks", block_size=4, num_blocks=3)
    assert type(sel).__module__ == "kvsieve_example_selector.recent_blocks"
    plan = lower_config(SparseAttentionConfig("recent_blocks", {"block_size": 4, "num_blocks": 3}), num_layers=1)[0]
    spec = KVCacheSpec(num_layers=1, num_blocks=30, tokens_per_block=4, num_kv_heads=1, head_dim=8, max_requests=2,
                       max_blocks_per_seq=10)
    eng = Engine(KVCacheManager(spec), [SparseAttention(layer_idx=0, num_q_heads=2, num_kv_heads=1, head_dim=8,
                                                        plan=plan)], max_num_requests=2, max_num_tokens=64)
    eng.step([0], [21], 1, [(torch.randn(21, 2, 8), torch.randn(21, 1, 8), torch.randn(21, 1, 8))])
    eng.step([0], [1], 0, [(torch.randn(1, 2, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8))])
    (res,) = eng.step([0], [1], 0, [(torch.randn(1, 2, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8))])
    # kv_len 23: blocks 0, 4, 5 -> positions 0..3 and 16..22 = 11 of 23
    assert res.params.sparse_attn_indices.tolist() == [[0, 4, 5]]
    assert res.stats.attended == 11 and res.stats.dense == 23


def test_bad_config_and_unsupported_combinations_raise_at_configuration_time(installed_example):
    with pytest.raises(ValueError, match=r"streaming.num_sink must be < budget=8, got 8"):
        kvsieve.create_selector("streaming", budget=8, num_sink=8)
    with pytest.raises(ValueError, match="accepted fields"):
        kvsieve.create_selector("streaming", window=3)
    with pytest.raises(ValueError, match=r"does not support attention kind 'mla'; supported: \['gqa'\]"):
        lower_config(SparseAttentionConfig("recent_blocks"), num_layers=2, attention_kind="mla")
    with pytest.raises(ValueError, match=r"does not support phase 'context'; supported: \['generation'\]"):
        lower_config(SparseAttentionConfig("recent_blocks", phases=("context",)), num_layers=2)
    with pytest.raises(ValueError, match="dense_layers entry 5"):
        lower_config(SparseAttentionConfig("streaming", dense_layers=(5,)), num_layers=2)
    with pytest.raises(ValueError, match="unknown backend"):
        kvsieve.get_backend("magic")


def test_lowering_gives_dense_layers_none():
    plans = lower_config(SparseAttentionConfig("streaming", {"budget": 16}, dense_layers=(0, -1)), num_layers=4)
    assert plans[0] is None and plans[3] is None and plans[1] is plans[2] is not None
    assert plans[1].phases == {"context", "generation"}
    assert lower_config(None, num_layers=3) == [None, None, None]
