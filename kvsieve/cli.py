"""The ``kvsieve`` command: a thin dispatcher to one module per subcommand."""
from __future__ import annotations

import importlib
import sys

__all__ = ["main"]

# subcommand -> module exposing main(argv) -> int
SUBCOMMANDS = {"demo": "kvsieve.demo", "eval": "kvsieve.eval.cli",
               "distill-indexer": "kvsieve.eval.distill_indexer"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        known = ", ".join(sorted(SUBCOMMANDS))
        print(f"usage: kvsieve {{{known}}} [options]   (kvsieve SUBCOMMAND --help for its options)")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
