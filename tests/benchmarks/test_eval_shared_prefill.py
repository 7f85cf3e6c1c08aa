"""benchmarks/eval_shared_prefill.py end to end on the tiny random model: both sweeps run, the
prefill counts are those of one dense prefill per prompt plus one per prompt-selecting setting
against one per run, and the two summaries agree (the script exits otherwise)."""
from __future__ import annotations

from benchmarks.eval_shared_prefill import main


def test_prefill_counts_and_equal_summaries(tmp_path, capsys) -> None:
    results = main(["--set", "model=tiny-random", "--set", "tasks={passkey: {lengths: [300], depths: [20, 80]}}",
                    "--set", "selectors={oracle_topk: {budgets: [16, 64]}, snapkv: {budgets: [64], phases: [context]}}",
                    "--out", str(tmp_path)])
    # 2 prompts x (dense, 2 oracle_topk, snapkv) runs
    assert results["own prefill per run"]["prefills"] == 2 * 4
    assert results["shared prefill"]["prefills"] == 2 * (1 + 1)
    out = capsys.readouterr().out
    assert "CPU " in out and "load (1, 5, 15 min)" in out and "summary.csv equal: True" in out
