"""The refusals of speculative decoding with the plug-in (free of vLLM imports; docs/lossless.md,
"In vLLM"). vLLM speculates only with kvsieve's drafter (:data:`.draft_steps.DRAFTER`), and only
where the drafter's rule holds exactly: the selector serves the draft passes alone, every step vLLM
runs itself is its own dense attention, so the verified tokens are vLLM's own.

* :func:`check_speculation` (a worker, when the first plug-in layer is built): another speculative
  method with the plug-in on, and the drafter with what it cannot serve exactly.
* :func:`refuse_without_plugin` (the drafter's constructor): the drafter named while the plug-in is
  off in that process.
* :func:`refuse_request_setting` (admission, per request): a per-request kvsieve setting, which no
  draft pass can read under speculation (vLLM builds no entry-point logits processor then).
"""
from __future__ import annotations

from typing import Any

from ...sparse import LayerPlan
from ..transformers.speculate import speculation_refusal
from .config import PluginConfig, selects_in_prompt
from .draft_steps import DRAFTER, uses_drafter

__all__ = ["MAX_DRAFTS", "check_speculation", "refuse_without_plugin", "refuse_request_setting"]

PREFIX = "kvsieve vLLM plug-in"
#: the most draft tokens per step vLLM 0.32's rejection sampler takes (``rejection_sampler.MAX_SPEC_LEN``)
MAX_DRAFTS = 128


def check_speculation(vllm_config: Any, config: PluginConfig, plans: list[LayerPlan | None], *, device: str) -> None:
    """Refuse ``vllm_config.speculative_config`` (``method``, ``model``, ``num_speculative_tokens``)
    unless it is kvsieve's drafter on what the drafter serves exactly: a selector (not ``dense``) that
    selects in the generation phase only, whose budget is at least ``K`` positions, on vLLM's CPU
    platform without pipeline parallelism, with ``1 <= K <=`` :data:`MAX_DRAFTS`."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return
    if not uses_drafter(vllm_config):
        raise NotImplementedError(
            f"{PREFIX}: speculative decoding with method {spec.method!r} (speculative_config.method) is not "
            "supported with the plug-in on: vLLM verifies its drafts in rows of K+1 query tokens, which the "
            "selector would select as one prompt chunk, not as K+1 decode steps, so the verified tokens would "
            f"not be those of sparse decoding; draft with kvsieve's selector instead (method 'custom_class', model "
            f"{DRAFTER!r}), or turn the plug-in off")
    field = "speculative_config.num_speculative_tokens"
    k = spec.num_speculative_tokens
    if config.sparse is None:
        raise ValueError(f"{PREFIX}: kvsieve's drafter drafts with the plug-in's selector, and the plug-in serves "
                         f"dense attention ({config.source}); set a selector (e.g. quest:budget=512,page_size=16)")
    if device != "cpu":
        raise NotImplementedError(f"{PREFIX}: kvsieve's drafter runs on vLLM's CPU platform only, not on {device!r}")
    pp = int(vllm_config.parallel_config.pipeline_parallel_size)
    if pp > 1:
        raise NotImplementedError(
            f"{PREFIX}: kvsieve's drafter with pipeline_parallel_size={pp}: vLLM runs a proposer on the last "
            "stage only, and a draft pass needs every stage's layers; use tensor parallelism")
    if not 1 <= k <= MAX_DRAFTS:
        raise ValueError(f"{PREFIX}: {field}={k} is outside what vLLM's rejection sampler takes "
                         f"(1 to {MAX_DRAFTS})")
    if selects_in_prompt(config.sparse):
        raise ValueError(
            f"{PREFIX}: selector {config.sparse.selector!r} selects in the prompt (its phases include 'context'), "
            "but under kvsieve's drafter every prompt is vLLM's own dense attention (the verify pass reads the "
            "prompt's K/V, which must be dense decoding's); set phases: [generation] in a KVSIEVE_CONFIG file or "
            "--additional-config's kvsieve entry (a KVSIEVE_SELECTOR string cannot set phases)")
    why = speculation_refusal(k, plans, prefix_caching=False)
    if why is not None:
        raise ValueError(f"{PREFIX}: {field}={k} with kvsieve's drafter: {why.removeprefix('speculate: ')}")


def refuse_without_plugin(config: PluginConfig | None) -> None:
    """The drafter is named (``speculative_config.model``) but the plug-in is off: no selector."""
    if config is None:
        raise ValueError(f"{PREFIX}: speculative_config names kvsieve's drafter ({DRAFTER}) but the plug-in is not "
                         "enabled (set KVSIEVE_SELECTOR, KVSIEVE_CONFIG or additional_config's 'kvsieve' entry): the "
                         "drafter drafts with the plug-in's selector")


def refuse_request_setting(raw: object) -> None:
    """A request's ``extra_args["kvsieve"]`` (``raw``) while vLLM speculates with kvsieve's drafter."""
    raise ValueError(
        f"request parameter kvsieve={raw!r}: per-request kvsieve settings are not served under speculative decoding "
        "(vLLM then builds no entry-point logits processor, so no draft pass could read the setting); the drafts use "
        "the process's selector, the tokens are vLLM's own dense attention's; send the request without it")
