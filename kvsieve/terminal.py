"""What every kvsieve command shares at the terminal: help text without RST markup (:func:`plain`),
errors as one line (:func:`run_command`) and Ctrl-C held back while a library loads
(:func:`deferred_interrupt`).

A base module: it imports nothing of kvsieve, so every command module (``kvsieve.cli``,
``kvsieve.demo``, ``kvsieve.eval``'s commands, ``python -m kvsieve.eval``) can use it without
importing the ``kvsieve`` command line, which sits on top of them.
"""
from __future__ import annotations

import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["plain", "run_command", "deferred_interrupt"]


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


@contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Hold Ctrl-C back for the block: a SIGINT arriving inside it is recorded, and once the block
    has finished the previous handler gets it (Python's default raises ``KeyboardInterrupt`` there).

    For lazy imports of compiled libraries (matplotlib's pybind11 modules): a ``KeyboardInterrupt``
    raised inside a pybind11 module's initialisation becomes ``ImportError: initialization failed``
    and leaves the module half set up, and the interpreter can then abort at exit (``Fatal Python
    error: PyThreadState_Get``), so a Ctrl-C there would neither say what was saved nor exit with
    130. Python runs signal handlers in the main thread whichever thread the signal reached, so the
    handler is swapped rather than the thread's signal mask (torch's worker threads do not block
    SIGINT). Off the main thread, where handlers cannot be set, or where SIGINT's handler was not set
    from Python (``signal.getsignal`` gives ``None``: it could not be put back), the block runs as is."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        if callable(previous):
            previous(signal.SIGINT, None)
        elif previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)
