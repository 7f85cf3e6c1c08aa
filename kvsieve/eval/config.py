"""The sweep configuration: YAML file, then ``--set key=value`` overrides, then validation.

A selector entry gives its budgets in tokens or as a density of the context; the selector's own
declared budget knob and unit (``SparseSelector.budget``, e.g. Quest's ``budget`` in pages of
``page_size``, block_select's ``topk_blocks``) receive them through
:func:`kvsieve.sparse.lower_budget`, the one conversion. A new selector is one entry::

    selectors:
      quest:                      # label used in run folders and plots
        selector: quest           # registry name (default: the label)
        budgets: [64, 256]        # tokens per query; or sparsities: [...] or reduction_factors: [...]
        params: {page_size: 16}   # fixed config fields (the budget's unit size among them)
        calibrate: null           # a model-specific step run before the sweep (kvsieve/eval/calibration.py),
        calibrate_params: {}      # one the selector registers (kvsieve list calibration), and its options
        phases: [generation]      # where the selector acts (dense elsewhere); a selector that evicts
                                  # prompt tokens needs context here (refused without it)
        dense_layers: [0, 1]
        layer_types: [full_attention]  # or layers: [2, 3]; default: the full-attention layers of
                                       # an interleaved model (Gemma 3), else every layer

Budget vocabulary (docs/eval.md, "Budget vocabulary"), all logged per run: ``budget`` (tokens
attended per query and KV head), ``sparsity = 1 - budget / L`` (the fraction not attended; what
kvpress calls ``compression_ratio``) and ``reduction_factor = L / budget`` (the "400x" of RocketKV),
with ``L`` the context length of the cell; a density is attended as the most whole units of the
selector's knob within ``ceil(L * density)`` tokens, and a token budget must be whole units. The
key ``compression_ratios`` is refused: kvsieve once used that name for ``L / budget``, kvpress uses
it for the fraction removed; so are ``budget_params``, ``budget_multiple`` and ``sparsity_params``,
the hand conversions the selectors' declarations replaced; and ``prepare`` / ``prepare_params``, the
former names of ``calibrate`` / ``calibrate_params``.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ..sparse import SparseAttentionConfig, get_selector_class, lower_budget
from ..sparse.calibration import available_calibration_steps, get_calibration_step

__all__ = ["SelectorSpec", "TaskSpec", "EvalConfig", "Budget", "ConfigError", "load_config", "apply_overrides",
           "from_dict", "RESULT_NEUTRAL", "QUICK", "DEFAULT", "RECIPES", "SERVED", "SERVED_SMOLLM2", "QUICK_SERVED",
           "RULER", "PRESETS", "check_calibration", "ENGINES", "TRANSFORMERS", "VLLM"]

QUICK = "quick"
DEFAULT = "default"
RECIPES = "recipes"
SERVED, SERVED_SMOLLM2, QUICK_SERVED = "served", "served_smollm2", "quick_served"
RULER = "ruler"
PRESETS = (QUICK, DEFAULT, RECIPES, SERVED, SERVED_SMOLLM2, QUICK_SERVED, RULER)  # kvsieve/eval/configs/<name>.yaml
TRANSFORMERS, VLLM = "transformers", "vllm"
ENGINES = (TRANSFORMERS, VLLM)
_BUDGET_FORMS = ("budgets", "sparsities", "reduction_factors")
#: selector keys refused by name, with what to write instead
_REFUSED_SELECTOR_KEYS = {
    "compression_ratios": "refused: the name is ambiguous (kvpress means the fraction of the context removed, "
                          "1 - budget / L; kvsieve once meant L / budget). Write sparsities: [...] for the fraction "
                          "removed (kvpress's compression_ratio) or reduction_factors: [...] for L / budget"} | dict.fromkeys(
    ("budget_params", "budget_multiple", "sparsity_params"),
    "refused: each selector declares its budget knob and unit (kvsieve list selectors shows them) and the budget "
    "is converted to it in one place; give budgets: [...] in tokens, or sparsities: / reduction_factors:") | {
    "prepare": "refused: the key is now calibrate: (the model-specific step run before the sweep; kvsieve list "
               "calibration shows them)",
    "prepare_params": "refused: the key is now calibrate_params: (the options of the calibrate: step)"}
#: selector-entry keys renamed (the old name is refused wherever it is written, --set key=null included)
_RENAMED_SELECTOR_KEYS = ("prepare", "prepare_params")
#: EvalConfig fields that do not change a run's results; every other field (model, backend, seed and
#: any field added later) is part of each run's identity (see ``kvsieve.eval.run_plan.run_identity``)
RESULT_NEUTRAL = ("output_dir", "threads", "tasks", "selectors", "check", "share_prefill")


class ConfigError(ValueError):
    """A sweep config that cannot be honoured; the message names the key, what it expects and what is valid."""


@dataclass(frozen=True)
class Budget:
    """One point of a selector's budget axis, resolved for a context length."""

    label: str
    tokens: int
    sparsity: float
    reduction_factor: float
    knob: dict[str, Any]  # the selector's budget knob field -> value (kvsieve.sparse.lower_budget)


@dataclass
class SelectorSpec:
    """How the sweep builds a :class:`SparseAttentionConfig` for each budget (see module docstring)."""

    label: str
    selector: str
    budgets: list[float] = field(default_factory=list)
    sparsities: list[float] = field(default_factory=list)
    reduction_factors: list[float] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    calibrate: str | None = None
    calibrate_params: dict[str, Any] = field(default_factory=dict)
    phases: list[str] = field(default_factory=lambda: ["generation"])
    dense_layers: list[int] = field(default_factory=list)
    layers: list[int] | None = None
    layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        given = [f for f in _BUDGET_FORMS if getattr(self, f)]
        if len(given) != 1:
            raise ConfigError(f"selectors.{self.label}: give exactly one of {list(_BUDGET_FORMS)}, got {given}")
        for s in self.sparsities:
            if not 0 <= s < 1:
                raise ConfigError(f"selectors.{self.label}.sparsities entries must be in [0, 1), got {s}")
        for r in self.reduction_factors:
            if r < 1:
                raise ConfigError(f"selectors.{self.label}.reduction_factors entries (L / budget) must be >= 1, "
                                  f"got {r}")
        for b in self.budgets:
            if b < 1:
                raise ConfigError(f"selectors.{self.label}.budgets entries must be >= 1 token, got {b}")

    def resolve(self, length: int) -> list[Budget]:
        """The budget axis at context length ``length`` (tokens), each point lowered onto the
        selector's budget knob (:func:`kvsieve.sparse.lower_budget`); a budget it cannot honour
        is a :class:`ConfigError` naming the entry."""
        cls = get_selector_class(self.selector)
        form = next(f for f in _BUDGET_FORMS if getattr(self, f))
        out = []
        for x in getattr(self, form):
            if form == "budgets":
                label, given = f"b{int(x)}", {"tokens": int(x)}
            elif form == "sparsities":
                label, given = f"s{x:g}", {"sparsity": x}
            else:
                label, given = f"x{x:g}", {"reduction_factor": x}
            try:
                low = lower_budget(cls, self.params, length, **given)
            except ValueError as err:
                raise ConfigError(f"selectors.{self.label}: {err}") from None
            out.append(Budget(label, low.tokens, low.sparsity, low.reduction_factor, low.knob))
        return out

    def sparse_config(self, budget: Budget) -> SparseAttentionConfig:
        params = dict(self.params) | budget.knob
        return SparseAttentionConfig(self.selector, params, dense_layers=tuple(self.dense_layers),
                                     phases=tuple(self.phases) if self.phases else None,
                                     layers=None if self.layers is None else tuple(self.layers),
                                     layer_types=None if self.layer_types is None else tuple(self.layer_types))


@dataclass
class TaskSpec:
    """Which lengths (prompt tokens), needle depths (percent) and samples per cell a task runs, and
    the task's options (``params``, e.g. a RULER NIAH task's ``values: uuids``; ``kvsieve list tasks``)."""

    name: str
    lengths: list[int]
    depths: list[float] = field(default_factory=lambda: [50.0])
    samples: int = 1
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.lengths or any(n < 64 for n in self.lengths):
            raise ConfigError(f"tasks.{self.name}.lengths must be a non-empty list of lengths >= 64, got {self.lengths}")
        if self.samples < 1:
            raise ConfigError(f"tasks.{self.name}.samples must be >= 1, got {self.samples}")
        if not self.depths or any(not 0 <= d <= 100 for d in self.depths):
            raise ConfigError(f"tasks.{self.name}.depths must be a non-empty list of percentages in [0, 100], "
                              f"got {self.depths}")


@dataclass
class EvalConfig:
    """The whole sweep. ``model``: ``smollm2``, ``tiny-random`` or a local checkpoint directory;
    ``engine``: ``transformers`` (kvsieve's session) or ``vllm`` (the vLLM plug-in, :mod:`.served`);
    ``share_prefill``: the runs that can share a sample's dense prefill do (:mod:`.run_plan`); ``false``
    prefills every run on its own (the same results, at the cost of a prefill per run: to measure
    what sharing saves)."""

    model: str = "smollm2"
    engine: str = TRANSFORMERS
    output_dir: str = "eval_results"
    backend: str = "torch"
    check: int = 0
    seed: int = 0
    threads: int = 0
    share_prefill: bool = True
    tasks: list[TaskSpec] = field(default_factory=list)
    selectors: list[SelectorSpec] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tasks"] = {t.pop("name"): t for t in d["tasks"]}
        d["selectors"] = {s.pop("label"): s for s in d["selectors"]}
        return d


def _builtin(name: str) -> dict[str, Any]:
    text = resources.files("kvsieve.eval").joinpath("configs", f"{name}.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``key.sub=value`` (value parsed as YAML) into a copy of ``raw``; ``key=null`` deletes. A selector
    entry's renamed key (``prepare``, ``prepare_params``) is refused, naming its new name."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a mapping of keys to values, got {type(raw).__name__} {raw!r}")
    out = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        path, value = item.split("=", 1)
        keys = path.split(".")
        if len(keys) == 3 and keys[0] == "selectors" and keys[2] in _RENAMED_SELECTOR_KEYS:
            raise ConfigError(f"override {item!r}: {path}: {_REFUSED_SELECTOR_KEYS[keys[2]]}")
        node = out
        for depth, k in enumerate(keys[:-1]):
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                where = ".".join(keys[:depth + 1])
                raise ConfigError(f"override {item!r}: {where} is {type(node).__name__} {node!r}, not a mapping")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({str(err).splitlines()[0]})") from None
        if parsed is None:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = parsed
    return out


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_type_name(a) for a in args)
    if origin is list:
        return f"a list of {_type_name(args[0])}"
    if origin is dict:
        return f"a mapping of {_type_name(args[0])} to {_type_name(args[1])}"
    return {int: "int", float: "number", str: "str", bool: "bool", Any: "any value",
            type(None): "null"}.get(tp, getattr(tp, "__name__", str(tp)))


def _conforms(value: Any, tp: Any) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if origin in (types.UnionType, typing.Union):
        return any(_conforms(value, a) for a in args)
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_conforms(k, args[0]) and _conforms(v, args[1])
                                               for k, v in value.items())
    if tp is type(None):
        return value is None
    if isinstance(value, bool):
        return tp is bool
    if tp is float:
        return isinstance(value, (int, float))
    return isinstance(value, tp)


def _fields(cls: type, key: str, raw: Any, skip: tuple[str, ...], nested: tuple[str, ...] = ()) -> dict[str, Any]:
    """``raw`` checked against the fields of dataclass ``cls`` (names, and types except for the
    ``nested`` fields, which the caller checks); errors name ``key``."""
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls) if f.name not in skip and f.init]
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{key}: expected a mapping with keys {valid}, got {type(raw).__name__} {raw!r}")
    for name, value in raw.items():
        if name not in valid:
            close = difflib.get_close_matches(str(name), valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{key}.{name}: unknown key{hint}; valid keys: {valid}")
        if name not in nested and not _conforms(value, hints[name]):
            raise ConfigError(f"{key}.{name}: expected {_type_name(hints[name])}, got "
                              f"{type(value).__name__} {value!r}")
    return dict(raw)


def _named(kind: str, name: Any, valid: list[str]) -> None:
    if name not in valid:
        close = difflib.get_close_matches(str(name), valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{kind}: unknown name {name!r}{hint}; valid: {valid}")


def _mapping(key: str, raw: Any, example: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{key}: expected a mapping {{name: {{...}}}}, e.g. {example}; "
                          f"got {type(raw).__name__} {raw!r}")
    return raw


def check_calibration(spec: SelectorSpec) -> None:
    """Raise :class:`ConfigError` naming the key unless ``spec.calibrate`` is a calibration step registered
    for its selector (:mod:`kvsieve.sparse.calibration`) and ``spec.calibrate_params`` holds only that
    step's options."""
    where = f"selectors.{spec.label}"
    valid = available_calibration_steps()
    if spec.calibrate is None:
        if spec.calibrate_params:
            raise ConfigError(f"{where}.calibrate_params: given without calibrate; valid calibrate: {valid}")
        return
    if spec.calibrate not in valid:
        raise ConfigError(f"{where}.calibrate: unknown step {spec.calibrate!r}; valid: {valid}")
    step = get_calibration_step(spec.calibrate)
    if step.selector != spec.selector:
        raise ConfigError(f"{where}.calibrate: {spec.calibrate!r} calibrates selector {step.selector!r}, "
                          f"not {spec.selector!r}")
    unknown = set(spec.calibrate_params) - set(step.options)
    if unknown:
        raise ConfigError(f"{where}.calibrate_params: unknown option(s) {sorted(unknown)}; valid: "
                          f"{sorted(step.options)}")


def _check_task(spec: TaskSpec) -> None:
    """The task's own check of its options and of every length (before any model loads)."""
    from .tasks import get_task

    try:
        task = get_task(spec.name, spec.params)
    except ValueError as err:
        raise ConfigError(f"tasks.{spec.name}.params: {err}") from None
    for length in spec.lengths:
        try:
            task.check_length(length)
        except (ValueError, FileNotFoundError) as err:
            raise ConfigError(f"tasks.{spec.name}.lengths: {length}: {err}") from None


def from_dict(raw: dict[str, Any]) -> EvalConfig:
    """Validate a raw mapping (as read from YAML) into an :class:`EvalConfig`; a :class:`ConfigError`
    names the offending key, the expected type and the valid values."""
    from ..sparse import available_backends, available_selectors, create_selector, get_selector_class
    from .tasks import available_tasks

    top = _fields(EvalConfig, "config", raw, skip=(), nested=("tasks", "selectors"))
    tasks = []
    for name, v in _mapping("tasks", top.pop("tasks", None), "{passkey: {lengths: [1024]}}").items():
        _named("tasks", name, available_tasks())
        tasks.append(TaskSpec(name=name, **_fields(TaskSpec, f"tasks.{name}", v, skip=("name",))))
        _check_task(tasks[-1])
    sels = []
    for label, v in _mapping("selectors", top.pop("selectors", None), "{quest: {budgets: [64]}}").items():
        for key, why in _REFUSED_SELECTOR_KEYS.items():
            if isinstance(v, dict) and key in v:
                raise ConfigError(f"selectors.{label}.{key}: {why}")
        v = _fields(SelectorSpec, f"selectors.{label}", v, skip=("label",))
        v.setdefault("selector", label)
        _named(f"selectors.{label}.selector", v["selector"], available_selectors())
        sels.append(SelectorSpec(label=str(label), **v))
    cfg = EvalConfig(tasks=tasks, selectors=sels, **top)
    _named("backend", cfg.backend, available_backends())
    _named("engine", cfg.engine, list(ENGINES))
    if not cfg.tasks:
        raise ConfigError(f"tasks: the sweep has no task; valid tasks: {available_tasks()}")
    shortest = min(n for t in cfg.tasks for n in t.lengths)
    for s in cfg.selectors:  # the selector's own config check, before any model is loaded
        labels = [b.label for b in s.resolve(shortest)]
        if s.label == "dense" or len(set(labels)) != len(labels):
            raise ConfigError(f"selectors.{s.label}: run folders must be distinct: the label 'dense' is the "
                              f"dense run's and budgets must not repeat (got budgets {labels})")
        check_calibration(s)
        cls = get_selector_class(s.selector)
        if cls.capabilities.evicts and "context" in cls.capabilities.phases and "context" not in s.phases:
            raise ConfigError(f"selectors.{s.label}.phases: {s.phases} leave out the context phase, where selector "
                              f"{s.selector!r} evicts prompt tokens (its prompt-eviction stage), so it would not run "
                              f"as {s.selector!r}; write phases: {sorted(cls.capabilities.phases)} (every stage it has)")
        if s.calibrate is not None:  # its config is complete, and checked, once the model is calibrated
            continue
        try:
            for budget in s.resolve(shortest):
                create_selector(s.selector, **s.sparse_config(budget).params)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"selectors.{s.label}: {err}") from None
    return cfg


def _yaml_error(err: OSError | yaml.YAMLError) -> str:
    """One line naming the line and column of a YAML syntax error (1-based), when YAML gives them."""
    mark = getattr(err, "problem_mark", None)
    if mark is None:
        return str(err).splitlines()[0]
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    context = getattr(err, "context", None)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f" ({context})" if context else "")


def load_config(path: str | Path | None = None, *, preset: str | None = None,
                overrides: list[str] | None = None) -> EvalConfig:
    """A YAML file, or a built-in preset (:data:`PRESETS`), then the overrides."""
    if path is not None and preset is not None:
        raise ConfigError("give a config path or a preset, not both")
    if path:
        try:
            raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError(f"config file {path}: {_yaml_error(err)}") from None
    else:
        _named("preset", preset or DEFAULT, list(PRESETS))
        raw = _builtin(preset or DEFAULT)
    return from_dict(apply_overrides(raw or {}, overrides or []))
