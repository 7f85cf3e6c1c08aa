"""Accuracy against sparsity: tasks (passkey, RULER-style NIAH, variable tracking, attention
fidelity), the resumable sweep behind ``kvsieve eval``, its metrics and plots."""
from __future__ import annotations

from .config import EvalConfig, SelectorSpec, TaskSpec, load_config
from .model import LoadedModel, load_model
from .runner import plan_runs, run_sweep
from .tasks import Sample, Task, available_tasks, get_task, register_task

__all__ = ["EvalConfig", "SelectorSpec", "TaskSpec", "load_config", "LoadedModel", "load_model", "plan_runs",
           "run_sweep", "Sample", "Task", "available_tasks", "get_task", "register_task"]
