"""The ``kvsieve`` command: a thin dispatcher to one function per subcommand.

It sits on top of the package: it imports each subcommand's module (when that subcommand runs),
and none of them imports it. Errors are one line (``kvsieve <command>: error: ...``, exit status 2
for bad input, 1 otherwise; :func:`kvsieve.terminal.run_command`); ``--debug`` anywhere on the
command line prints the traceback as well.
"""
from __future__ import annotations

import sys
from collections.abc import Callable

from .terminal import run_command

__all__ = ["main", "SUBCOMMANDS"]


# each subcommand's module is imported only when it runs (``kvsieve --help`` loads none of them)
def _eval(argv: list[str]) -> int:
    from .eval.cli import main as eval_main

    return eval_main(argv)


def _list(argv: list[str]) -> int:
    from .eval.cli import list_main

    return list_main(argv)


def _demo(argv: list[str]) -> int:
    from .demo import main as demo_main

    return demo_main(argv)


def _distill_indexer(argv: list[str]) -> int:
    from .eval.distill_indexer import main as distill_main

    return distill_main(argv)


# subcommand -> (function taking argv and returning an exit status, one-line description)
SUBCOMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "eval": (_eval, "accuracy-vs-sparsity sweep on a model: resumable, one folder per run, summary.csv, plots "
                    "and report.md"),
    "list": (_list, "list selectors, backends, models or tasks, each with a description and its defaults"),
    "demo": (_demo, "one selector through the paged cache against the dense golden (about a minute)"),
    "distill-indexer": (_distill_indexer, "train a DSA indexer for a GQA model"),
}


def _help() -> str:
    from . import __version__

    width = max(map(len, SUBCOMMANDS))
    lines = [f"kvsieve {__version__}: sparse-attention plug-ins for paged-KV LLM inference", "",
             "usage: kvsieve [--version] [--help] [--debug] COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {desc}" for name, (_, desc) in SUBCOMMANDS.items()]
    lines += ["", "kvsieve COMMAND --help shows a command's options; --debug shows tracebacks of errors."]
    return "\n".join(lines)


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
    return run_command(f"kvsieve {argv[0]}", SUBCOMMANDS[argv[0]][0], argv[1:], debug=debug)


if __name__ == "__main__":
    sys.exit(main())
