"""The plug-in contract: params, selector base class, registry, config lowering, the layer, backends,
calibration steps."""
from __future__ import annotations

from .selector_base import Capabilities, SelectorInputs, SparseSelector, attach_refusal
from .attention import LayerOutput, LayerStats, SparseAttention, commit_evictions
from .backends import (AttentionBackend, AttentionGeometry, AttentionResult, available_backends, get_backend,
                       register_backend)
from .budget import BUDGET_UNITS, BudgetKnob, LoweredBudget, lower_budget
from .engine import Engine
from .config import LayerPlan, SparseAttentionConfig, lower_config
from .params import SparseRuntimeParams, is_dense
from .calibration import (CalibrationContext, CalibrationStep, Document, LayerCapture, available_calibration_steps,
                          get_calibration_step, register_calibration_step)
from .registry import ENTRY_POINT_GROUP, PluginError, available_selectors, create_selector, get_selector_class, register_selector
from .selection import attended_counts, selection_mask

__all__ = [
    "Capabilities", "attach_refusal", "Engine", "SelectorInputs", "SparseSelector", "LayerOutput", "LayerStats", "SparseAttention",
    "commit_evictions", "AttentionBackend", "AttentionGeometry", "AttentionResult", "available_backends",
    "get_backend", "register_backend", "PluginError", "is_dense", "LayerPlan",
    "SparseAttentionConfig", "lower_config", "SparseRuntimeParams", "ENTRY_POINT_GROUP",
    "available_selectors", "create_selector", "get_selector_class", "register_selector", "attended_counts",
    "selection_mask", "BUDGET_UNITS", "BudgetKnob", "LoweredBudget", "lower_budget", "Document", "LayerCapture",
    "CalibrationContext", "CalibrationStep", "available_calibration_steps", "get_calibration_step",
    "register_calibration_step",
]
