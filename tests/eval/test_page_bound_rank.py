"""tools/page_bound_rank.py: on keys whose pages are sorted by a channel the bound ranks exactly;
the command runs on the tiny random model and prints one line per asked layer."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("page_bound_rank", ROOT / "tools" / "page_bound_rank.py")
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


def test_bound_ranks_exactly_when_one_channel_sorts_the_pages():
    k = torch.zeros(64, 1, 4)
    k[:, 0, 0] = torch.arange(64).float()  # page j holds 16j..16j+15 on channel 0
    q = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    r = tool.page_bound_rank(q, k, page_size=16, reduction_factor=4)
    assert r["rank_corr"] > 0.999 and r["top_overlap"] == 1.0
    assert abs(r["page_range"] - (15 / 63 + 3 * 0) / 4) < 1e-6  # channels 1..3 are constant (range clamped)


def test_random_keys_rank_worse_than_sorted_and_the_command_prints_each_layer():
    g = torch.Generator().manual_seed(0)
    r = tool.page_bound_rank(torch.randn(2, 32, generator=g), torch.randn(1024, 1, 32, generator=g), 16, 16)
    assert r["rank_corr"] < 0.9
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "page_bound_rank.py"), "--model", "tiny-random",
                          "--length", "256", "--layers", "0", "1"], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout
    assert len(re.findall(r"layer (\d): D=\d+ Hq/Hkv=\d+/\d+ \| rank corr -?[\d.]+ \| top 1/16 page overlap", out)) == 2
