"""How ``kvsieve eval --engine vllm`` runs a sweep's runs in vLLM, and what it refuses.

* **Engines**: vLLM's own attention (plug-in off) runs the dense runs and is the speed baseline;
  each selector entry gets one engine with the plug-in (the selector is fixed per process), its
  budgets set per request (``SamplingParams(extra_args={"kvsieve": {"budget": N}})``, docs/vllm.md
  "Per-request settings"), plus one run per entry and length with ``{"dense": true}``
  (budget label :data:`PLUGIN_DENSE`): dense attention through the plug-in, whose answers must be
  vLLM's own.
* **Prefix caching** stays on. A selector that selects in the context phase writes prompt K/V (and
  per-block state) that depend on the request's setting, so each setting gets its own
  ``cache_salt`` (:func:`cache_salt`) and requests share cached prompt blocks only within one
  setting; a generation-only selector writes dense prompt K/V, shared by every setting.
* **The ``acceptance`` task** runs on lossless engines of its own, one per run and draft length,
  the entry's config at the run's budget (:mod:`.lossless`): it measures the accepted length and the
  lossless speed-up where they are served.
* **Engine settings** are fixed (:func:`engine_identity`, part of every run's identity).
* **Refused by name** (:func:`check_served`): a task that is not a generation task (``fidelity``
  reads attention inside kvsieve's session), ``check`` (the vanilla golden check of kvsieve's
  session), ``share_prefill: false`` (the engines' prefix caches share prompts), an entry with ``layers`` / ``layer_types`` (the plug-in takes ``dense_layers`` only;
  sliding-window layers stay vLLM's own), a selector the plug-in refuses at start-up (evicting
  ones, ``skip_softmax`` on CPU, ``dsa`` without projections: ``vllm.config.lower_plans``), and a
  budget the plug-in's admission check would refuse or lower to another knob value than the
  transformers path's.
"""
from __future__ import annotations

from typing import Any

from ...integrations.vllm.config import PluginConfig, selects_in_prompt
from ...integrations.vllm.startup import check_plugin_config
from ...integrations.vllm.request_settings import parse_request_setting
from ...sparse import SparseAttentionConfig
from ..config import QUICK_SERVED, Budget, ConfigError, EvalConfig, SelectorSpec
from ..tasks import get_task

__all__ = ["DTYPE", "DECODE_TOKENS", "TIMING_REPS", "MAX_NUM_SEQS", "kv_cache_gib", "PLUGIN_DENSE", "SERVED_FIELDS", "engine_identity",
           "plugin_dense_budget", "request_setting", "cache_salt", "process_config", "check_served"]

DTYPE = "float32"  # the transformers path's dtype (kvsieve.eval.model.load_model)
DECODE_TOKENS = 16  # tokens generated per decode-speed measurement
TIMING_REPS = 3  # measurements per run, each beside one of vLLM's own attention at the same length
#: requests an engine runs at once; its KV cache holds them all at full length, so vLLM never
#: preempts (a preempted request's recomputed tokens would be attended densely by a generation-only
#: selector, docs/vllm.md "Preemption with a generation-only selector")
MAX_NUM_SEQS = 4
PLUGIN_DENSE = "dense"
#: summary.csv columns the vLLM path adds
SERVED_FIELDS = ("decode_speedup", "decode_tok_s", "own_decode_tok_s", "load_1m", "lossless_speedup_k2",
                 "lossless_speedup_k4", "lossless_speedup_k8")


def kv_cache_gib(model_config: Any, max_model_len: int) -> int:
    """GiB of KV cache for :data:`MAX_NUM_SEQS` requests of ``max_model_len`` tokens in fp32 (K and V
    of every layer, ``model_config``: the transformers config), with a quarter to spare; at least 1."""
    cfg = getattr(model_config, "text_config", model_config)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
    return max(1, -(-int(1.25 * MAX_NUM_SEQS * max_model_len * per_token) // 2 ** 30))


def engine_identity() -> dict[str, Any]:
    """What the vLLM path fixes for every run (part of its identity)."""
    return {"name": "vllm", "dtype": DTYPE, "decode_tokens": DECODE_TOKENS, "timing_reps": TIMING_REPS,
            "max_num_seqs": MAX_NUM_SEQS,
            "prefix_caching": "on, one cache_salt per setting for selectors that select in the context phase"}


#: what the refusals that stop the quick preset (its fidelity task, snapkv) add
QUICK_HINT = f" (the quick preset's servable part: --preset {QUICK_SERVED})"


def plugin_dense_budget(length: int) -> Budget:
    """The budget point of an entry's ``{"dense": true}`` run at ``length``."""
    return Budget(PLUGIN_DENSE, length, 0.0, 1.0, {})


def request_setting(budget: Budget) -> dict[str, Any]:
    """``extra_args["kvsieve"]`` of a request of this budget point."""
    return {"dense": True} if budget.label == PLUGIN_DENSE else {"budget": budget.tokens}


def cache_salt(spec: SelectorSpec, budget: Budget) -> str | None:
    """The prompt's ``cache_salt``: one per setting when the entry selects in the context phase."""
    return f"kvsieve:{request_setting(budget)}" if selects_in_prompt(spec.sparse_config(budget)) else None


def process_config(spec: SelectorSpec, length: int) -> SparseAttentionConfig:
    """The engine's own config for an entry: its first budget at ``length`` (requests set theirs)."""
    return spec.sparse_config(spec.resolve(length)[0])


def _check_entry(spec: SelectorSpec, lengths: list[int]) -> None:
    where = f"selectors.{spec.label}"
    if spec.layers is not None or spec.layer_types is not None:
        raise ConfigError(f"{where}: layers / layer_types are not served by the vLLM plug-in (it takes dense_layers; "
                          "sliding-window layers stay vLLM's own); remove them for --engine vllm")
    # prompt_settings: every setting's prompts are salted apart (cache_salt), as the engine's config file declares
    process = PluginConfig(process_config(spec, min(lengths)), prompt_settings=True, source=f"{where} (--engine vllm)")
    try:
        check_plugin_config(process, device="cpu")
    except ValueError as err:
        raise ConfigError(f"{where}: not served by the vLLM plug-in: {err}{QUICK_HINT}") from None
    for length in lengths:
        for budget in spec.resolve(length):
            try:
                setting = parse_request_setting(request_setting(budget), process)
            except ValueError as err:
                raise ConfigError(f"{where}: budget {budget.label} at {length} tokens: {err}") from None
            knob = dict(setting.knob) if setting is not None else {k: process.sparse.params.get(k) for k in budget.knob}
            if knob != budget.knob:
                raise ConfigError(f"{where}: budget {budget.label} at {length} tokens: a request's budget of "
                                  f"{budget.tokens} tokens becomes {knob} in the plug-in, not {budget.knob}")


def check_served(cfg: EvalConfig, *, calibrated: bool) -> None:
    """Raise :class:`ConfigError` naming what the vLLM path cannot run exactly (module docstring).
    Entries with a calibration step are checked once ``calibrated`` (their projections exist then)."""
    if cfg.check:
        raise ConfigError("check: the golden check compares kvsieve's session with its vanilla backend; the vLLM "
                          "path has none (tests/vllm checks the plug-in against the golden); set check=0")
    if not cfg.share_prefill:
        raise ConfigError("share_prefill: false prefills every run in kvsieve's session; through vLLM the prompts "
                          "share the engine's prefix cache, which the sweep does not switch off")
    for t in cfg.tasks:
        if get_task(t.name).kind != "generate":
            raise ConfigError(f"tasks.{t.name}: a {get_task(t.name).kind} task reads attention inside kvsieve's "
                              f"session; --engine vllm runs generation tasks only{QUICK_HINT}")
    lengths = sorted({n for t in cfg.tasks for n in t.lengths})
    for spec in cfg.selectors:
        if spec.calibrate is None or calibrated:
            _check_entry(spec, lengths)
