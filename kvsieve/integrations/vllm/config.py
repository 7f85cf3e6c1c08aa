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

The plug-in is active only when ``KVSIEVE_SELECTOR`` or ``KVSIEVE_CONFIG`` is set; setting both
is an error. What a config may not ask (selectors that evict prompt tokens, per-step model inputs
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
           "DENSE", "ENV_SELECTOR", "ENV_CONFIG", "ENV_BACKEND", "ENV_CAPTURE", "ENV_CHECK_STATE",
           "ENV_PROMPT_SETTINGS", "selects_in_prompt"]

ENV_SELECTOR = "KVSIEVE_SELECTOR"
ENV_CONFIG = "KVSIEVE_CONFIG"
ENV_BACKEND = "KVSIEVE_BACKEND"
ENV_CAPTURE = "KVSIEVE_CAPTURE"
ENV_CHECK_STATE = "KVSIEVE_CHECK_STATE"
ENV_PROMPT_SETTINGS = "KVSIEVE_PROMPT_SETTINGS"
DENSE = "dense"
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


def _from_file(path: Path) -> tuple[SparseAttentionConfig | None, str | None]:
    raw = _read_file(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{ENV_CONFIG}={path}: the file must hold a mapping with keys {list(_FILE_KEYS)}")
    unknown = sorted(set(raw) - set(_FILE_KEYS))
    if unknown:
        raise ValueError(f"{ENV_CONFIG}={path}: unknown keys {unknown}; known: {list(_FILE_KEYS)}")
    if "selector" not in raw:
        raise ValueError(f"{ENV_CONFIG}={path}: 'selector' is required (a selector name or 'dense')")
    backend = raw.get("backend")
    if raw["selector"] == DENSE:
        extra = sorted(k for k in ("params", "dense_layers", "phases") if raw.get(k))
        if extra:
            raise ValueError(f"{ENV_CONFIG}={path}: selector 'dense' takes no {extra}")
        return None, backend
    phases = raw.get("phases")
    sparse = SparseAttentionConfig(selector=str(raw["selector"]), params=dict(raw.get("params") or {}),
                                   dense_layers=tuple(raw.get("dense_layers") or ()),
                                   phases=tuple(phases) if phases else None)
    return sparse, backend


def read_plugin_config(environ: dict[str, str] | None = None) -> PluginConfig | None:
    """The plug-in's config from the environment, or ``None`` when the plug-in is not enabled."""
    env = os.environ if environ is None else environ
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
