"""The ``kvsieve`` command: a thin dispatcher to one function per subcommand.

Errors are one line (``kvsieve <command>: error: ...``, exit status 2 for bad input, 1 otherwise);
``--debug`` anywhere on the command line prints the traceback as well.
"""
from __future__ import annotations

import importlib
import re
import sys
import traceback

__all__ = ["main", "plain", "SUBCOMMANDS"]

# subcommand -> ("module:function" taking argv and returning an exit status, one-line description)
SUBCOMMANDS = {
    "eval": ("kvsieve.eval.cli:main", "accuracy-vs-sparsity sweep on a model: resumable, one folder per run, "
                                      "summary.csv, plots and report.md"),
    "list": ("kvsieve.eval.cli:list_main", "list selectors, backends, models or tasks, each with a description "
                                           "and its defaults"),
    "demo": ("kvsieve.demo:main", "one selector through the paged cache against the dense golden (about a minute)"),
    "distill-indexer": ("kvsieve.eval.distill_indexer:main", "train a DSA indexer for a GQA model"),
}


def plain(doc: str) -> str:
    """A docstring for a terminal: RST roles and literals (``x``, :class:`~a.b.C`) as plain text."""
    doc = re.sub(r":\w+:`~?(?:[\w.]+\.)?([^`]+)`", r"\1", doc)
    return doc.replace("``", "")


def _help() -> str:
    from . import __version__

    width = max(map(len, SUBCOMMANDS))
    lines = [f"kvsieve {__version__}: sparse-attention plug-ins for paged-KV LLM inference", "",
             "usage: kvsieve [--version] [--help] [--debug] COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {desc}" for name, (_, desc) in SUBCOMMANDS.items()]
    lines += ["", "kvsieve COMMAND --help shows a command's options; --debug shows tracebacks of errors."]
    return "\n".join(lines)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or "(no message)"
    return text if isinstance(err, ValueError) else f"{type(err).__name__}: {text}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    if not argv or argv[0] in ("-h", "--help"):
        print(_help())
        return 0
    if argv[0] == "--version":
        from . import __version__

        print(f"kvsieve {__version__}")
        return 0
    if argv[0] not in SUBCOMMANDS:
        print(f"kvsieve: error: unknown command {argv[0]!r}; commands: {', '.join(SUBCOMMANDS)} "
              "(kvsieve --help)", file=sys.stderr)
        return 2
    prog = f"kvsieve {argv[0]}"
    module, func = SUBCOMMANDS[argv[0]][0].split(":")
    try:
        return getattr(importlib.import_module(module), func)(argv[1:])
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # every error: one line, the traceback on request
        if debug:
            traceback.print_exc()
        hint = "" if debug else " (--debug shows the traceback)"
        print(f"{prog}: error: {_one_line(err)}{hint}", file=sys.stderr)
        return 2 if isinstance(err, ValueError) else 1


if __name__ == "__main__":
    sys.exit(main())
