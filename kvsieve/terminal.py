"""What every kvsieve command shares at the terminal: help text without RST markup (:func:`plain`)
and errors as one line (:func:`run_command`).

A base module: it imports nothing of kvsieve, so every command module (``kvsieve.cli``,
``kvsieve.demo``, ``kvsieve.eval``'s commands, ``python -m kvsieve.eval``) can use it without
importing the ``kvsieve`` command line, which sits on top of them.
"""
from __future__ import annotations

import re
import sys
import traceback
from collections.abc import Callable

__all__ = ["plain", "run_command"]


def plain(doc: str) -> str:
    """A docstring for a terminal: RST roles and literals (``x``, :class:`~a.b.C`) as plain text."""
    doc = re.sub(r":\w+:`~?(?:[\w.]+\.)?([^`]+)`", r"\1", doc)
    return doc.replace("``", "")


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or "(no message)"
    return text if isinstance(err, ValueError) else f"{type(err).__name__}: {text}"


def run_command(prog: str, command: Callable[[list[str]], int], argv: list[str], *, debug: bool = False) -> int:
    """``command(argv)``'s exit status; an error becomes one line ``<prog>: error: ...`` on stderr
    (exit status 2 for bad input, a ``ValueError``, 1 otherwise; the traceback too with ``debug``),
    Ctrl-C exit status 130."""
    try:
        return command(argv)
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # every error: one line, the traceback on request
        if debug:
            traceback.print_exc()
        hint = "" if debug else " (--debug shows the traceback)"
        print(f"{prog}: error: {_one_line(err)}{hint}", file=sys.stderr)
        return 2 if isinstance(err, ValueError) else 1
