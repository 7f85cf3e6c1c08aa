"""Sparsity per request: what a request may ask, checked against the process's selector, and the
setting of each row of vLLM's persistent batch (free of vLLM imports; the vLLM side is
:mod:`.settings_processor`).

A request asks through ``SamplingParams(extra_args={"kvsieve": ...})`` (on the OpenAI server:
``"vllm_xargs": {"kvsieve": "budget=256"}``), as a mapping or as a string in
``KVSIEVE_SELECTOR``'s field syntax (:func:`.config.parse_fields`). Fields (:data:`REQUEST_FIELDS`):

* ``budget``: positions attended per query, in tokens, lowered onto the process selector's budget
  knob by :func:`kvsieve.sparse.lower_budget` (the one conversion; a budget that is not a whole
  number of the knob's units, or below one unit, is refused naming the knob);
* ``dense``: ``true`` = the request attends densely on every layer and phase the selector runs.

Everything else is fixed for the process and refused by name: the selector's other config fields
(unit sizes such as Quest's ``page_size`` shape the per-block state every request shares), another
selector's fields, and densities (``sparsity`` / ``reduction_factor``: lowering one needs the
request's context length, which vLLM's admission check does not see; lower it on the client with
:func:`kvsieve.sparse.lower_budget` and send ``budget``). A setting equal to the process default
is the default (``None``), so such requests take the process's own path.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...sparse import get_selector_class, lower_budget
from .config import ENV_PROMPT_SETTINGS, PluginConfig, parse_fields, selects_in_prompt

__all__ = ["EXTRA_ARGS_KEY", "REQUEST_FIELDS", "RequestSetting", "parse_request_setting", "BatchRows",
           "batch_rows", "row_settings", "row_prompt_lens", "setting_ids"]

#: the key of ``SamplingParams.extra_args`` (and of the OpenAI server's ``vllm_xargs``)
EXTRA_ARGS_KEY = "kvsieve"
#: the fields a request may set
REQUEST_FIELDS = ("budget", "dense")
_DENSITIES = ("sparsity", "reduction_factor", "density")


@dataclass(frozen=True)
class RequestSetting:
    """One request's setting other than the process default: ``dense`` (the request attends
    densely), or ``knob``, the selector's budget-knob field and its value, e.g.
    ``(("budget", 128),)`` for Quest. Hashable: rows with equal settings run as one group."""

    dense: bool = False
    knob: tuple[tuple[str, Any], ...] = ()

    def describe(self) -> str:
        return "dense" if self.dense else ",".join(f"{k}={v}" for k, v in self.knob)


def parse_request_setting(raw: object, config: PluginConfig | None) -> RequestSetting | None:
    """``extra_args["kvsieve"]`` (a mapping, or a string ``"budget=256"``) of one request ->
    its setting, ``None`` for the process default. ``config``: the process's plug-in config
    (``None``: the plug-in is not enabled). Raises ``ValueError`` naming the field and what the
    process's selector accepts."""
    where = f"request parameter {EXTRA_ARGS_KEY}={raw!r}"
    if config is None:
        raise ValueError(f"{where}: the kvsieve vLLM plug-in is not enabled in this server's environment (set "
                         "KVSIEVE_SELECTOR or KVSIEVE_CONFIG to serve per-request settings; vLLM's front end, which "
                         "admits requests, never sees --additional-config's 'kvsieve' entry)")
    if isinstance(raw, str):
        fields = parse_fields(raw, where)
    elif isinstance(raw, Mapping):
        fields = dict(raw)
    else:
        raise ValueError(f"{where}: give a mapping or a string like 'budget=256', got {type(raw).__name__}")
    sparse = config.sparse
    selector = None if sparse is None else get_selector_class(sparse.selector)
    for name in fields:
        if name in REQUEST_FIELDS:
            continue
        if name in _DENSITIES:
            raise ValueError(f"{where}: field {name!r} (a density) is not taken per request: lowering it needs the "
                             "request's context length, which vLLM's admission check does not see; give 'budget' in "
                             "tokens (kvsieve.sparse.lower_budget turns a density at a length into one)")
        own = selector is not None and name in {f.name for f in dataclasses.fields(selector.config_class)}
        why = (f"a field of selector {sparse.selector!r} fixed for the process ({config.source})" if own
               else f"not a per-request field of the process's selector "
                    f"({'dense' if sparse is None else repr(sparse.selector)}, {config.source})")
        raise ValueError(f"{where}: field {name!r} is {why}; a request may set {list(REQUEST_FIELDS)}")
    dense = fields.get("dense", False)
    if not isinstance(dense, bool):
        raise ValueError(f"{where}: field 'dense' must be true or false, got {dense!r}")
    if "budget" not in fields:
        return _prompt_settings_allowed(RequestSetting(dense=True), where, config) if dense and sparse is not None \
            else None
    budget = fields["budget"]
    if dense:
        raise ValueError(f"{where}: fields 'dense' and 'budget' contradict each other; give one")
    if sparse is None:
        raise ValueError(f"{where}: field 'budget' needs a selector, but the process serves dense attention "
                         f"({config.source})")
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise ValueError(f"{where}: field 'budget' must be a whole number of tokens, got {budget!r}")
    if selector.budget is None or selector.budget.unit == "sparsity":
        raise ValueError(f"{where}: field 'budget': selector {sparse.selector!r} has no budget in tokens to set per "
                         "request (its budget knob is none or a kernel threshold for the whole step)")
    try:
        knob = lower_budget(selector, sparse.params, max(budget, 1), tokens=budget).knob
        selector.config_class(**{**sparse.params, **knob})
    except ValueError as e:
        raise ValueError(f"{where}: field 'budget': {e}") from None
    default = {f.name: f.default for f in dataclasses.fields(selector.config_class)}
    if all(sparse.params.get(k, default[k]) == v for k, v in knob.items()):
        return None
    return _prompt_settings_allowed(RequestSetting(knob=tuple(sorted(knob.items()))), where, config)


def _prompt_settings_allowed(setting: RequestSetting, where: str, config: PluginConfig) -> RequestSetting:
    """``setting``, unless the process's selector selects in the prompt and the process did not declare
    that its prefix cache keeps settings apart (:data:`.config.ENV_PROMPT_SETTINGS`): the request's
    prompt K/V then depend on its setting, and the prefix cache would share them with other settings'
    requests."""
    if selects_in_prompt(config.sparse) and not config.prompt_settings:
        raise ValueError(
            f"{where}: selector {config.sparse.selector!r} selects in the prompt, so a request's setting changes the "
            "K/V its prompt leaves in the cache, and vLLM's prefix cache would hand them to requests of other "
            "settings; keep settings apart in the prefix cache (--no-enable-prefix-caching, or one cache_salt per "
            f"setting on every such request) and start the server with {ENV_PROMPT_SETTINGS}=1 ({config.source})")
    return setting


class BatchRows:
    """What kvsieve keeps of each row of vLLM's persistent batch (batch index -> the row's request
    setting and its request's prompt length; rows without a setting use the process default), kept
    from vLLM's batch updates in vLLM's order: removed, then added, then moved (:meth:`update`). The
    batch index is the row of the step's attention metadata (vLLM's model runner builds
    ``query_start_loc`` over ``input_batch.req_ids``). The prompt length tells a recomputed request's
    generated tokens from its prompt: vLLM computes a request it preempted again as one prompt of
    its prompt and the tokens it had generated, re-adding it with its original prompt."""

    def __init__(self) -> None:
        self._settings: dict[int, RequestSetting] = {}
        self._prompt_lens: dict[int, int] = {}

    def update(self, removed: Iterable[int], added: Iterable[tuple[int, RequestSetting | None, int | None]],
               moved: Iterable[tuple[int, int, bool]]) -> None:
        """``removed``: indices left empty; ``added``: ``(index, setting, prompt length)`` (``None``:
        not known), replacing what the index held; ``moved``: ``(a, b, swap)``, the row at ``a`` goes to ``b`` (and ``b``'s
        to ``a`` when ``swap``)."""
        for i in removed:
            self._settings.pop(i, None)
            self._prompt_lens.pop(i, None)
        for i, setting, prompt_len in added:
            self._settings.pop(i, None)
            if setting is not None:
                self._settings[i] = setting
            self._prompt_lens.pop(i, None)
            if prompt_len is not None:
                self._prompt_lens[i] = prompt_len
        for a, b, swap in moved:
            for table in (self._settings, self._prompt_lens):
                at_a, at_b = table.pop(a, None), table.pop(b, None)
                if at_a is not None:
                    table[b] = at_a
                if swap and at_b is not None:
                    table[a] = at_b

    def settings(self, num_rows: int) -> tuple[RequestSetting | None, ...] | None:
        """The settings of rows ``[0, num_rows)`` (``None`` entries: the default), or ``None`` when
        every row uses the process default."""
        if not any(i < num_rows for i in self._settings):
            return None
        return tuple(self._settings.get(i) for i in range(num_rows))

    def prompt_lens(self, num_rows: int) -> np.ndarray:
        """int32 ``[num_rows]``: the prompt length of each row's request. Raises ``RuntimeError``
        naming the rows the table does not know, an empty table included: vLLM's own dummy steps
        (its profile and warm-up runs) build no attention metadata and never ask (:data:`.router.DUMMY_STEP`),
        so a step that asks holds requests, and without a row's prompt length a recomputed request's
        generated tokens would be taken for prompt tokens."""
        missing = [i for i in range(num_rows) if i not in self._prompt_lens]
        if not missing:
            return np.fromiter((self._prompt_lens[i] for i in range(num_rows)), dtype=np.int32, count=num_rows)
        raise RuntimeError(
            f"kvsieve vLLM plug-in: rows {missing} of a {num_rows}-row step have no prompt length in the batch "
            "table (vLLM added them without prompt token ids, or the table missed a batch update); kvsieve "
            "cannot tell their prompt tokens from generated ones. The table follows vLLM 0.32's V1 model runner "
            "(VLLM_USE_V2_MODEL_RUNNER=0) through kvsieve's KvsieveRequestSettings logits processor, with prompts "
            "given as token ids; unset KVSIEVE_SELECTOR/KVSIEVE_CONFIG to run vLLM's own attention")


_CURRENT: list[BatchRows | None] = [None]


def batch_rows() -> BatchRows:
    """A new table for this process's persistent batch, the one :func:`row_settings` and
    :func:`row_prompt_lens` read from now on (vLLM builds its logits processors again when it
    rebuilds the batch)."""
    _CURRENT[0] = BatchRows()
    return _CURRENT[0]


def row_settings(num_rows: int) -> tuple[RequestSetting | None, ...] | None:
    """The settings of this step's rows ``[0, num_rows)`` in vLLM's order, ``None`` when every row
    uses the process default (or no table is kept in this process)."""
    table = _CURRENT[0]
    return None if table is None else table.settings(num_rows)


def row_prompt_lens(num_rows: int) -> np.ndarray:
    """int32 ``[num_rows]``: the prompt length of the request of each of this step's rows in vLLM's
    order (:meth:`BatchRows.prompt_lens`, which refuses rows it does not know). Raises
    ``RuntimeError`` when this process keeps no table: vLLM built no ``KvsieveRequestSettings``
    processor here."""
    table = _CURRENT[0]
    if table is None:
        raise RuntimeError(
            "kvsieve vLLM plug-in: this process has no batch table, so the prompt lengths of the step's rows "
            "are not known: vLLM did not build kvsieve's logits processor (KvsieveRequestSettings, registered "
            "by the vllm.logits_processors entry point of the kvsieve package installed in vLLM's environment)")
    return table.prompt_lens(num_rows)


def setting_ids(settings: tuple[RequestSetting | None, ...]) -> np.ndarray:
    """int64 ``[len(settings)]``: 0 for the default, then 1, 2, ... in order of first appearance."""
    ids: dict[RequestSetting | None, int] = {None: 0}
    return np.array([ids.setdefault(s, len(ids)) for s in settings], dtype=np.int64)

