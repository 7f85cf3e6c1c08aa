"""Accuracy against sparsity: tasks (passkey, RULER-style NIAH, variable tracking, attention
fidelity), the resumable sweep behind ``kvsieve eval``, its metrics and plots."""
from __future__ import annotations

from .config import ConfigError, EvalConfig, SelectorSpec, TaskSpec, load_config
from .model import LoadedModel, load_model
from .run_plan import plan_runs
from .runner import SweepInterrupted, SweepResult, run_sweep
from .tasks import Sample, Task, available_tasks, get_task, register_task
from . import acceptance  # noqa: F401,E402  registers the "acceptance" task (lossless decoding)

__all__ = ["ConfigError", "SweepInterrupted", "SweepResult", "EvalConfig", "SelectorSpec", "TaskSpec", "load_config", "LoadedModel", "load_model", "plan_runs",
           "run_sweep", "Sample", "Task", "available_tasks", "get_task", "register_task"]
