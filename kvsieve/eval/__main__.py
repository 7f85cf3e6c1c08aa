"""``python -m kvsieve.eval`` is ``kvsieve eval`` (the same one-line errors; ``--debug`` shows the
traceback)."""
from __future__ import annotations

import sys

from ..terminal import run_command
from .cli import main

_argv = sys.argv[1:]
sys.exit(run_command("kvsieve eval", main, [a for a in _argv if a != "--debug"], debug="--debug" in _argv))
