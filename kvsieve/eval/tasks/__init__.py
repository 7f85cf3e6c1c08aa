"""Task registry; importing this package registers the built-in tasks."""
from __future__ import annotations

from .base import Sample, Task, available_tasks, get_task, register_task
from .fidelity import FidelityTask
from .niah import NiahMultiKeyTask, NiahSingleTask
from .passkey import PasskeyTask
from .variable_tracking import VariableTrackingTask

__all__ = ["Sample", "Task", "available_tasks", "get_task", "register_task", "FidelityTask", "NiahSingleTask",
           "NiahMultiKeyTask", "PasskeyTask", "VariableTrackingTask"]
