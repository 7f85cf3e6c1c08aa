"""The ``kvsieve`` command line: help, version, list, one-line errors (tracebacks with --debug),
config validation that names key, expected type and valid values, --no-progress."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvsieve import __version__, available_selectors
from kvsieve.cli import SUBCOMMANDS, main


def _run(capsys, *argv):
    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_version_and_help(capsys):
    rc, out, _ = _run(capsys, "--version")
    assert rc == 0 and out.strip() == f"kvsieve {__version__}"
    rc, out, _ = _run(capsys, "--help")
    assert rc == 0
    for name in SUBCOMMANDS:
        line = next(line for line in out.splitlines() if line.strip().startswith(name + " "))
        assert len(line.split()) > 3, line  # the name and a description
    rc, _, err = _run(capsys, "evl")
    assert rc == 2 and "unknown command 'evl'" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", list(SUBCOMMANDS))
def test_subcommand_help_has_no_rst_markup(capsys, command):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and "usage: kvsieve " + command in out
    assert "``" not in out and ":func:" not in out


def test_list(capsys):
    rc, out, _ = _run(capsys, "list", "selectors")
    assert rc == 0
    for name in available_selectors():
        assert f"  {name} " in out
    assert "budget=256, page_size=16" in out  # quest's defaults
    assert "budget knob: budget (tokens in whole units of page_size tokens)" in out  # quest's declared knob
    assert "budget knob: topk_blocks (blocks of block_size tokens)" in out
    assert "Quest (arXiv 2406.10774): query-aware page selection at decode time." in out
    rc, out, _ = _run(capsys, "list", "backends")
    assert "torch " in out and "default on cpu" in out and "vanilla " in out
    rc, out, _ = _run(capsys, "list", "models")
    assert "smollm2" in out and "tiny-random" in out
    rc, out, _ = _run(capsys, "list", "tasks")
    assert "passkey" in out and "metric: attention-mass recall" in out
    rc, out, _ = _run(capsys, "list")
    assert all(f"{kind}:" in out for kind in ("selectors", "backends", "models", "tasks"))


@pytest.mark.parametrize("override, message", [
    ("tasks=[passkey]", "tasks: expected a mapping {name: {...}}"),
    ("tasks.passkey.depth=[10]", "tasks.passkey.depth: unknown key (did you mean 'depths'?); valid keys: "
                                 "['lengths', 'depths', 'samples', 'params']"),
    ("tasks.passkey.lengths=1024", "tasks.passkey.lengths: expected a list of int, got int 1024"),
    ("tasks.passkey.samples=two", "tasks.passkey.samples: expected int, got str 'two'"),
    ("tasks.paskey.lengths=[1024]", "tasks: unknown name 'paskey' (did you mean 'passkey'?)"),
    ("selectors.quset.budgets=[64]", "selectors.quset.selector: unknown name 'quset' (did you mean 'quest'?); "
                                     "valid: ["),
    ("selectors.quest.params=16", "selectors.quest.params: expected a mapping of str to any value, got int 16"),
    ("seed=zero", "config.seed: expected int, got str 'zero'"),
    ("selectors.quest.budgets=[64, 64.0]", "selectors.quest: run folders must be distinct"),
    ("selectors.dense={selector: quest, budgets: [64]}", "selectors.dense: run folders must be distinct"),
    ("selectors.quest.params={page_sise: 16}", "selectors.quest: selector 'quest': bad config ['budget', 'page_sise']"),
    ("backend=tritn", "backend: unknown name 'tritn' (did you mean 'triton'?)"),
    ("tasks.passkey.depths=[120]", "tasks.passkey.depths must be a non-empty list of percentages in [0, 100]"),
    ("tasks.passkey.lengths=[1024", "the value is not valid YAML"),
])
def test_bad_config_is_one_clear_line(capsys, override, message):
    rc, out, err = _run(capsys, "eval", "--quick", "--set", override)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvsieve eval: error: "), err
    assert message in lines[0]
    assert "Traceback" not in err


def test_debug_shows_the_traceback(capsys):
    rc, _, err = _run(capsys, "eval", "--quick", "--set", "tasks=[passkey]", "--debug")
    assert rc == 2 and "Traceback (most recent call last)" in err and "ConfigError" in err


def test_missing_config_file(capsys, tmp_path):
    rc, _, err = _run(capsys, "eval", "--config", str(tmp_path / "nope.yaml"))
    assert rc == 2 and f"config file {tmp_path / 'nope.yaml'}" in err and len(err.strip().splitlines()) == 1


def test_no_progress_silences_transformers_bars(monkeypatch):
    import tqdm.auto
    import tqdm.std
    from transformers.utils import logging as hf_logging

    from kvsieve.eval.cli import silence_progress_bars

    monkeypatch.setattr(tqdm.std.tqdm, "__init__", tqdm.std.tqdm.__init__)  # restored afterwards
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")
    before = tqdm.auto.tqdm(range(2), desc="before", file=open("/dev/null", "w"))
    assert not before.disable
    before.close()
    try:
        silence_progress_bars()
        assert not hf_logging.is_progress_bar_enabled()
        # transformers' GGUF loader calls tqdm.auto.tqdm directly, with no disable argument
        bar = tqdm.auto.tqdm(range(2), desc="Converting and de-quantizing GGUF tensors...")
        assert bar.disable
        bar.close()
    finally:
        hf_logging.enable_progress_bar()


def test_python_m_kvsieve_eval_is_kvsieve_eval():
    """``python -m kvsieve.eval`` runs eval's own command (not through ``kvsieve.cli``, which eval
    never imports) with the same one-line errors."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "kvsieve.eval", "--quick", "--set", "seed=zero"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [
        "kvsieve eval: error: config.seed: expected int, got str 'zero' (--debug shows the traceback)"]
