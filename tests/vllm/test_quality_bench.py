"""``benchmarks/vllm_quality.py --shared-prefill``, CI-sized (issue 65, item 2: samples cost prefills,
not settings): SmolLM2-135M, two passkey prompts of about 1K tokens, vLLM's own attention and a Quest
engine that answers each prompt densely first, then with its budget, then at a per-request budget
(``--budgets``). The dense answers, dense attention through the plug-in, equal vLLM's own tokens
prompt for prompt; the budgets' requests found their prompts in vLLM's prefix cache (they only
decoded); every column is scored."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.platforms", reason="vLLM is not installed (it runs in its own venv, see .ci/run)")

import test_engine  # noqa: E402

model_dir = test_engine.model_dir  # the fixture: SmolLM2-135M converted once
ROOT = Path(__file__).resolve().parents[2]
QUEST = "quest:budget=64,page_size=16"


def test_shared_prefill_dense_column_is_owns_and_the_setting_decodes_from_the_cache(model_dir, tmp_path):  # noqa: F811
    cmd = [sys.executable, str(ROOT / "benchmarks" / "vllm_quality.py"), "--model", str(model_dir), "--length", "1024",
           "--tasks", "passkey", "--depths", "50", "--samples", "2", "--batch", "2", "--modes", f"own;{QUEST}",
           "--shared-prefill", "--budgets", "32", "--out", str(tmp_path)]
    done = subprocess.run(cmd, env=test_engine._env(), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = tmp_path.glob("vllm_quality-*.json")
    out = json.loads(path.read_text())
    assert out["same_tokens_as_own"][f"dense@{QUEST}"] == 2
    assert {r["mode"] for r in out["table"]} == {"own", f"dense@{QUEST}", QUEST, f"{QUEST}@budget=32"}
    own_run, quest_run = out["runs"]
    assert set(quest_run["generate_seconds"]) == {"dense", "mode", "budget=32"}
    assert set(own_run["generate_seconds"]) == {"mode"}
    # every full block of each prompt came from the cache the dense wave filled (the last partial block
    # and the last token are computed again)
    for wave in ("mode", "budget=32"):
        assert quest_run["prefix_cache_hit_tokens"][wave] >= 0.75 * quest_run["prompt_tokens"]
