"""``kvsieve eval``: run an accuracy-vs-sparsity sweep from a YAML config with overrides."""
from __future__ import annotations

import argparse

from .config import QUICK, load_config
from .runner import run_sweep
from .tasks import available_tasks

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvsieve eval", description=__doc__)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", help="YAML sweep config (default: the built-in 'default' preset)")
    src.add_argument("--quick", action="store_true", help="the built-in quick preset (< 10 min on 2 CPU cores)")
    p.add_argument("--model", help="a built-in ('smollm2' default, 'gemma3-270m', 'tiny-random'), a .gguf file, "
                                   "or a transformers checkpoint folder")
    p.add_argument("--output-dir", help="where run folders, summary.csv and plots go")
    p.add_argument("--backend", help="kvsieve attention backend (default: torch; 'vanilla' is the golden)")
    p.add_argument("--check", type=int, metavar="N",
                   help="compare N random generation steps with the vanilla golden during the run (raises on a mismatch)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, dotted, value in YAML (repeatable), e.g. "
                        "--set tasks.passkey.lengths=[1024] --set selectors.quest=null")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--list-tasks", action="store_true", help="print the registered tasks and exit")
    args = p.parse_args(argv)
    if args.list_tasks:
        print("\n".join(available_tasks()))
        return 0
    overrides = list(args.overrides)
    for key in ("model", "output_dir", "backend", "check"):
        value = getattr(args, key)
        if value is not None:
            overrides.append(f"{key}={value}")
    cfg = load_config(args.config, preset=QUICK if args.quick else None, overrides=overrides)
    run_sweep(cfg, progress=not args.no_progress)
    return 0
