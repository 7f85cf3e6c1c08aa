"""The plug-in's configuration: read from the environment once per process, checked at start-up.

* ``KVSIEVE_SELECTOR="quest:budget=256,page_size=16"``: a selector and its config fields (values
  parsed as YAML scalars), or ``"dense"`` (no selector: on CPU every layer is vLLM's own
  attention; on CUDA kvsieve's backend computes it);
* or ``KVSIEVE_CONFIG=/path/to/file.{json,yaml,yml}`` with keys ``selector`` (name or
  ``"dense"``), ``params`` (mapping), ``dense_layers`` (list of layer indices, negative from the
  end), ``phases`` (subset of ``["context", "generation"]``), ``backend`` (kvsieve backend name);
* ``KVSIEVE_BACKEND``: the kvsieve backend of what vLLM's own kernels do not take (default
  ``torch`` on CPU, ``triton`` on CUDA; on CPU dense rows and whole-block decode selections run
  vLLM's kernels, :mod:`.host`); elsewhere prompt rows a layer does not select take SDPA over a
  block-wise gather of the view (:func:`.step.dense_context_rows`), whatever the backend;
* ``KVSIEVE_CAPTURE=/dir``: for tests, every layer also runs kvsieve's Vanilla golden on the same
  selection and appends the largest difference to ``/dir/capture-<pid>.jsonl``;
* ``KVSIEVE_CHECK_STATE=1`` (or ``check_state: true`` in the file; ``0``/``false`` off, the
  default): a debug check, at every layer step, of the selector's per-block state against a
  recomputation (:mod:`.state_check`), raising on a difference; refused for a selector with no
  per-block state it knows;
* ``KVSIEVE_PROMPT_SETTINGS=1`` (or ``prompt_settings: true`` in the file): under a selector that
  selects in the prompt, a request may carry its own setting (:mod:`.request_settings`), which
  changes its prompt's K/V. It is the operator's declaration that vLLM's prefix cache keeps
  settings apart (prefix caching off, or one ``cache_salt`` per setting on every such request),
  which the plug-in cannot see. Without it such a request is refused at admission.

The same settings come the vLLM way as the ``kvsieve`` entry of vLLM's ``--additional-config``
(``LLM(additional_config=...)``, :data:`ADDITIONAL_KEYS`), one key per variable:
``{"selector": "quest", "budget": 256}`` (the selector's name, its fields beside it, plus
``dense_layers`` / ``phases`` as in the file) or ``{"config": "/path/file.yaml"}``, and ``backend``,
``capture``, ``check_state``, ``prompt_settings``. Both routes at once, or one setting given twice
(``selector`` and ``config``, or the file and the entry), are refused.

The plug-in is active only when ``KVSIEVE_SELECTOR`` or ``KVSIEVE_CONFIG`` is set, or the
``kvsieve`` entry; setting both variables is an error. What a config may not ask (selectors that evict prompt tokens, per-step model inputs
other than DSA's indexer, ...) is refused at start-up by :mod:`.startup`.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ...sparse import SparseAttentionConfig, get_selector_class

__all__ = ["PluginConfig", "WorkerRanks", "read_plugin_config", "parse_selector_spec", "parse_fields",
           "DENSE", "ADDITIONAL_ENTRY", "ADDITIONAL_KEYS", "ENV_SELECTOR", "ENV_CONFIG", "ENV_BACKEND", "ENV_CAPTURE", "ENV_CHECK_STATE",
           "ENV_PROMPT_SETTINGS", "selects_in_prompt"]

ENV_SELECTOR = "KVSIEVE_SELECTOR"
ENV_CONFIG = "KVSIEVE_CONFIG"
ENV_BACKEND = "KVSIEVE_BACKEND"
ENV_CAPTURE = "KVSIEVE_CAPTURE"
ENV_CHECK_STATE = "KVSIEVE_CHECK_STATE"
ENV_PROMPT_SETTINGS = "KVSIEVE_PROMPT_SETTINGS"
DENSE = "dense"
ADDITIONAL_ENTRY = "kvsieve"  # vLLM's additional_config["kvsieve"]
# the entry's keys -> the environment variable saying the same (a selector's fields sit beside "selector")
ADDITIONAL_KEYS = {"selector": ENV_SELECTOR, "config": ENV_CONFIG, "backend": ENV_BACKEND, "capture": ENV_CAPTURE,
                   "check_state": ENV_CHECK_STATE, "prompt_settings": ENV_PROMPT_SETTINGS}
_PLAN_KEYS = ("dense_layers", "phases")  # beside "selector", as in a KVSIEVE_CONFIG file
_FILE_KEYS = ("selector", "params", "dense_layers", "phases", "backend", "check_state", "prompt_settings")
_FLAGS = {"1": True, "true": True, "0": False, "false": False}


@dataclass(frozen=True)
class PluginConfig:
    """``sparse``: the kvsieve config (``None`` = dense); ``backend``: kvsieve backend name or
    ``None`` for the device default; ``capture_dir``: where the golden check writes, or ``None``;
    ``check_state``: check the selector's per-block state at every layer step (:mod:`.state_check`);
    ``prompt_settings``: per-request settings may change prompts' K/V, the prefix cache keeping
    settings apart (module docstring)."""

    sparse: SparseAttentionConfig | None
    backend: str | None = None
    capture_dir: Path | None = None
    check_state: bool = False
    prompt_settings: bool = False
    source: str = field(default="", compare=False)


@dataclass(frozen=True)
class WorkerRanks:
    """This process's place in vLLM's parallel layout: its tensor-parallel rank among
    ``tp_size`` workers (each holding a shard of every layer's heads) and its pipeline stage among
    ``pp_size`` (each holding a contiguous range of the layers, numbered as in the whole model)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1


def _scalar(text: str) -> Any:
    value = yaml.safe_load(text)
    if isinstance(value, (dict, list)) or value is None:
        raise ValueError(f"selector parameter value {text!r} must be a scalar (number, bool or string)")
    return value


def parse_fields(text: str, where: str) -> dict[str, Any]:
    """``"key=value,key=value"`` (the field syntax of ``KVSIEVE_SELECTOR`` after the name; values
    parsed as YAML scalars) -> a dict; errors name ``where`` and the item."""
    params: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{where}: parameter {item!r} must look like key=value")
        if key.strip() in params:
            raise ValueError(f"{where}: parameter {key.strip()!r} given twice")
        params[key.strip()] = _scalar(value.strip())
    return params


def parse_selector_spec(spec: str) -> SparseAttentionConfig | None:
    """``"name"`` or ``"name:key=value,key=value"`` -> a config; ``"dense"`` -> ``None``."""
    name, _, rest = spec.strip().partition(":")
    name = name.strip()
    if not name:
        raise ValueError(f"{ENV_SELECTOR}={spec!r}: give a selector name, e.g. 'quest:budget=256'")
    params = parse_fields(rest, f"{ENV_SELECTOR}={spec!r}")
    if name == DENSE:
        if params:
            raise ValueError(f"{ENV_SELECTOR}={spec!r}: 'dense' takes no parameters")
        return None
    return SparseAttentionConfig(selector=name, params=params)


def _read_file(path: Path) -> Any:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        return json.loads(text)
    if path.suffix in (".yaml", ".yml"):
        return yaml.safe_load(text)
    raise ValueError(f"{ENV_CONFIG}={path}: the file must end in .json, .yaml or .yml")


def _sparse(selector: object, params: Mapping[str, Any], dense_layers: object, phases: object,
            where: str) -> SparseAttentionConfig | None:
    """A file's or an additional-config entry's selector (``"dense"``: ``None``), fields and plan keys."""
    if not isinstance(selector, str) or not selector:
        raise ValueError(f"{where}: 'selector' must be a selector name or 'dense', got {selector!r}")
    if selector == DENSE:
        extra = sorted(k for k, v in (("params", params), ("dense_layers", dense_layers), ("phases", phases)) if v)
        if extra:
            raise ValueError(f"{where}: selector 'dense' takes no {extra}")
        return None
    for key, value in (("dense_layers", dense_layers), ("phases", phases)):
        if value is not None and not isinstance(value, list):
            raise ValueError(f"{where}: {key} must be a list, got {value!r}")
    return SparseAttentionConfig(selector=selector, params=dict(params), dense_layers=tuple(dense_layers or ()),
                                 phases=tuple(phases) if phases else None)


def _from_file(path: Path) -> tuple[SparseAttentionConfig | None, str | None]:
    raw = _read_file(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{ENV_CONFIG}={path}: the file must hold a mapping with keys {list(_FILE_KEYS)}")
    unknown = sorted(set(raw) - set(_FILE_KEYS))
    if unknown:
        raise ValueError(f"{ENV_CONFIG}={path}: unknown keys {unknown}; known: {list(_FILE_KEYS)}")
    if "selector" not in raw:
        raise ValueError(f"{ENV_CONFIG}={path}: 'selector' is required (a selector name or 'dense')")
    sparse = _sparse(raw["selector"], raw.get("params") or {}, raw.get("dense_layers"), raw.get("phases"),
                     f"{ENV_CONFIG}={path}")
    return sparse, raw.get("backend")


def read_plugin_config(environ: Mapping[str, str] | None = None,
                       additional: object = None) -> PluginConfig | None:
    """The plug-in's config from the environment, or from ``additional`` (vLLM's
    ``VllmConfig.additional_config``: its ``kvsieve`` entry), or ``None`` when the plug-in is not
    enabled. Both routes at once are refused, naming the variables set."""
    env = os.environ if environ is None else environ
    entry = additional.get(ADDITIONAL_ENTRY) if isinstance(additional, dict) else None
    if entry is not None:
        named = sorted(v for v in ADDITIONAL_KEYS.values() if env.get(v))
        if named:
            raise ValueError(f"--additional-config '{ADDITIONAL_ENTRY}' and the environment's {named} both configure "
                             "the kvsieve plug-in; use one route")
        return _from_additional(entry)
    spec, path = env.get(ENV_SELECTOR), env.get(ENV_CONFIG)
    if spec and path:
        raise ValueError(f"set {ENV_SELECTOR} or {ENV_CONFIG}, not both ({ENV_SELECTOR}={spec!r}, {ENV_CONFIG}={path!r})")
    if not spec and not path:
        return None
    if spec:
        sparse, backend, source = parse_selector_spec(spec), None, f"{ENV_SELECTOR}={spec}"
    else:
        sparse, backend = _from_file(Path(path))
        source = f"{ENV_CONFIG}={path}"
    env_backend = env.get(ENV_BACKEND)
    if env_backend and backend and env_backend != backend:
        raise ValueError(f"{ENV_BACKEND}={env_backend!r} contradicts backend {backend!r} in {path}")
    capture = env.get(ENV_CAPTURE)
    return PluginConfig(sparse=sparse, backend=env_backend or backend, capture_dir=Path(capture) if capture else None,
                        check_state=_flag(env, ENV_CHECK_STATE, "check_state", Path(path) if path else None),
                        prompt_settings=_flag(env, ENV_PROMPT_SETTINGS, "prompt_settings", Path(path) if path else None),
                        source=source)


def _from_additional(entry: object) -> PluginConfig:
    """The ``kvsieve`` entry of vLLM's additional config (module docstring); errors name the key."""
    where = f"--additional-config '{ADDITIONAL_ENTRY}'"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: must be a mapping of settings (keys {list(ADDITIONAL_KEYS)}), got {entry!r}")
    where = f"{where} {json.dumps(entry, sort_keys=True)}"
    if ("selector" in entry) == ("config" in entry):
        raise ValueError(f"{where}: give exactly one of 'selector' (a name and its fields) or 'config' (a file)")
    for key in ("backend", "capture", "config"):
        if key in entry and (not isinstance(entry[key], str) or not entry[key]):
            raise ValueError(f"{where}: {key!r} must be a non-empty string, got {entry[key]!r}")
    for key in ("check_state", "prompt_settings"):
        if key in entry and not isinstance(entry[key], bool):
            raise ValueError(f"{where}: {key!r} must be true or false, got {entry[key]!r}")
    settings = {k: entry.get(k) for k in ("backend", "check_state", "prompt_settings")}
    if "config" in entry:
        path = Path(entry["config"])
        stray = sorted(set(entry) - set(ADDITIONAL_KEYS))
        if stray:
            raise ValueError(f"{where}: unknown keys {stray} beside 'config' (selector fields, dense_layers and "
                             f"phases go in the file); known: {list(ADDITIONAL_KEYS)}")
        sparse, _ = _from_file(path)
        in_file = _read_file(path)
        twice = sorted(k for k, v in settings.items() if v is not None and k in in_file)
        if twice:
            raise ValueError(f"{where}: {twice} given twice, in the entry and in the file {path}")
        settings = {"backend": settings["backend"] or in_file.get("backend"),
                    **{k: _flag({}, ADDITIONAL_KEYS[k], k, path) if settings[k] is None else settings[k]
                       for k in ("check_state", "prompt_settings")}}
    else:
        fields = {k: v for k, v in entry.items() if k not in ADDITIONAL_KEYS and k not in _PLAN_KEYS}
        sparse = _sparse(entry["selector"], fields, entry.get("dense_layers"), entry.get("phases"), where)
    capture = entry.get("capture")
    return PluginConfig(sparse=sparse, backend=settings["backend"], capture_dir=Path(capture) if capture else None,
                        check_state=bool(settings["check_state"]), prompt_settings=bool(settings["prompt_settings"]),
                        source=where)


def _flag(env: Mapping[str, str], name: str, key: str, path: Path | None) -> bool:
    """The environment's flag ``name`` (``1``/``true``/``0``/``false``) and the file's ``key`` (a
    bool); they must agree when both are given."""
    flag, value = env.get(name), None
    if flag is not None:
        if flag.strip().lower() not in _FLAGS:
            raise ValueError(f"{name}={flag!r}: give 1, true, 0 or false")
        value = _FLAGS[flag.strip().lower()]
    raw = None if path is None else _read_file(path).get(key)  # the file was checked (_from_file)
    if raw is not None and not isinstance(raw, bool):
        raise ValueError(f"{ENV_CONFIG}={path}: {key} must be true or false, got {raw!r}")
    if value is not None and raw is not None and value != raw:
        raise ValueError(f"{name}={flag!r} contradicts {key}: {raw} in {path}")
    return bool(value if value is not None else raw)


def selects_in_prompt(sparse: SparseAttentionConfig | None) -> bool:
    """Whether ``sparse``'s selector selects in the prompt (context) phase, where a request's
    setting changes the K/V its prompt leaves in the cache (``None``: dense, never)."""
    if sparse is None:
        return False
    return "context" in (sparse.phases or get_selector_class(sparse.selector).capabilities.phases)
