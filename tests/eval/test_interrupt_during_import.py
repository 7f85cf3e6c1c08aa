"""Ctrl-C while ``kvsieve eval`` loads a compiled library: held back until the import is done
(:func:`kvsieve.terminal.deferred_interrupt`), so the sweep's interrupt path runs (exit 130, what was
saved) instead of ``ImportError: initialization failed`` and an abort at exit. The intermittent
failure of ``test_kill_resume.py::test_sigint_says_what_was_saved_and_how_to_resume`` was this: its
SIGINT landed while ``write_plots`` imported matplotlib's pybind11 modules.

The tests raise SIGINT with ``signal.raise_signal``: the signal goes to the calling (main) thread and
its Python handler runs before the call returns, so where the signal lands does not depend on how
busy the machine is. (``os.kill`` sends it to the process: any thread may take it, and the main
thread runs the handler when it next checks, which under load came after a 50 ms sleep.)"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvsieve.terminal import deferred_interrupt

ROOT = Path(__file__).resolve().parents[2]


def test_a_sigint_inside_the_block_is_raised_after_it():
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    done = []
    with pytest.raises(KeyboardInterrupt):  # without the block, it is raised by raise_signal itself
        signal.raise_signal(signal.SIGINT)
        done.append("unblocked")
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupt():
            signal.raise_signal(signal.SIGINT)  # the block's handler has run when this returns: recorded
            done.append("blocked")
    assert done == ["blocked"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is restored


# A fresh interpreter: the first import of one of matplotlib's compiled modules raises SIGINT in the
# main thread; write_plots must finish importing matplotlib (pyplot included) before the interrupt lands.
CHILD = r'''
import builtins, pathlib, signal, sys
real = builtins.__import__
sent = []
def hook(name, *args, **kwargs):
    if not sent and name.startswith("matplotlib") and "_path" in (name + str(args[2] if len(args) > 2 else "")):
        sent.append(name)
        signal.raise_signal(signal.SIGINT)
    return real(name, *args, **kwargs)
builtins.__import__ = hook
from kvsieve.eval.plots import write_plots
row = {"task": "passkey", "length": 100, "selector": "dense", "budget_label": "full", "budget_tokens": 100,
       "target_sparsity": 0.0, "achieved_sparsity": 0.0, "score": 1.0, "ci95_low": 0.5, "ci95_high": 1.0, "n": 2}
try:
    write_plots(pathlib.Path(sys.argv[1]), [row])
    print("no interrupt")
except KeyboardInterrupt:
    print("interrupt after import:", bool(sent), "matplotlib.pyplot" in sys.modules)
'''


def test_a_sigint_during_write_plots_import_of_matplotlib_lands_after_it(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "interrupt after import: True True", (done.stdout, done.stderr[-3000:])
