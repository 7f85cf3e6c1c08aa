"""Task registry; importing this package registers the built-in tasks."""
from __future__ import annotations

from .aggregation import CommonWordsTask, FrequentWordsTask
from .base import Sample, Task, available_tasks, get_task, register_task
from .continuation import ContinuationTask
from .fidelity import FidelityTask
from .niah import NiahMultiKeyTask, NiahSingleTask, RulerNiahTask
from .passkey import PasskeyTask
from .variable_tracking import VariableTrackingTask

__all__ = ["Sample", "Task", "available_tasks", "get_task", "register_task", "CommonWordsTask", "ContinuationTask",
           "FidelityTask", "FrequentWordsTask", "NiahSingleTask", "NiahMultiKeyTask", "PasskeyTask", "RulerNiahTask",
           "VariableTrackingTask"]
