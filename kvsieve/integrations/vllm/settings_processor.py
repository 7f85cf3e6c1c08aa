"""The route of per-request settings into vLLM (:mod:`.request_settings`): a vLLM v1 logits
processor, registered under vLLM's ``vllm.logits_processors`` entry point (pyproject.toml), which
changes no logit and exists for two of vLLM's calls:

* ``validate_params`` (a classmethod vLLM's input processor calls on every request at admission,
  in the API server's or the offline engine's own process; also under speculative decoding, where
  vLLM builds no entry-point logits processor, so a setting is refused there): a setting the
  process's selector cannot honour raises there, so vLLM refuses that request alone (``VLLMValidationError``, HTTP 400 on the
  OpenAI server) before it is scheduled;
* ``update_state(BatchUpdate)`` (in every worker process, before each step whose batch changed,
  after vLLM added, removed, condensed and reordered its persistent batch and before it builds the
  step's attention metadata): the batch indices it names are the rows of that metadata, so the
  plug-in's metadata builder reads each row's setting from :func:`.request_settings.row_settings`,
  and its request's prompt length from :func:`.request_settings.row_prompt_lens` (the prompt token
  ids vLLM hands with every added row, a resumed one included).

vLLM's V2 model runner (``VLLM_USE_V2_MODEL_RUNNER=1``; the default where Triton is installed)
calls another interface; the class declares both so vLLM loads it under either runner, and under
V2 it refuses to start while the plug-in is enabled (the V2 batch is not followed).
"""
from __future__ import annotations

import sys
from functools import lru_cache

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as LogitsProcessorV2

from .config import PluginConfig, read_plugin_config
from .draft_checks import refuse_request_setting
from .draft_steps import uses_drafter
from .request_settings import EXTRA_ARGS_KEY, RequestSetting, batch_rows, parse_request_setting

__all__ = ["KvsieveRequestSettings"]


@lru_cache(maxsize=1)
def _plugin_config() -> PluginConfig | None:
    """The process's plug-in config (its environment does not change), read once."""
    return read_plugin_config()


def _setting(params: SamplingParams) -> RequestSetting | None:
    extra = params.extra_args or {}
    return parse_request_setting(extra[EXTRA_ARGS_KEY], _plugin_config()) if EXTRA_ARGS_KEY in extra else None


def _admitting_engine_drafts() -> bool:
    """Whether the engine admitting this request speculates with kvsieve's drafter. vLLM hands
    ``validate_params`` the sampling parameters alone, so this reads the config of vLLM's input
    processor up the call stack (``InputProcessor._validate_params``, vLLM 0.32); ``False`` when
    no input processor is calling (a direct call)."""
    from vllm.v1.engine.input_processor import InputProcessor

    frame = sys._getframe(1)
    while frame is not None:
        caller = frame.f_locals.get("self")
        if isinstance(caller, InputProcessor):
            return uses_drafter(caller.vllm_config)
        frame = frame.f_back
    return False


class KvsieveRequestSettings(LogitsProcessor, LogitsProcessorV2):
    """Follows each request's ``extra_args["kvsieve"]`` through vLLM's persistent batch; logits pass
    unchanged (module docstring)."""

    def __init__(self, vllm_config: object, *runner_args: object) -> None:
        if not isinstance(runner_args[0], torch.device) and _plugin_config() is not None:
            raise NotImplementedError(
                "kvsieve vLLM plug-in: per-request settings follow vLLM's V1 model runner batch; the V2 model runner "
                "is in use (set VLLM_USE_V2_MODEL_RUNNER=0)")
        self.rows = batch_rows()

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the field when the request's ``extra_args["kvsieve"]`` asks what
        the process's selector cannot honour, and any such setting while the engine speculates with
        kvsieve's drafter (:func:`.draft_checks.refuse_request_setting`)."""
        extra = sampling_params.extra_args or {}
        if EXTRA_ARGS_KEY in extra and _admitting_engine_drafts():
            refuse_request_setting(extra[EXTRA_ARGS_KEY])
        _setting(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        # a prompt given as embeddings has no token ids (refused at start-up while the plug-in is on)
        self.rows.update(batch_update.removed, ((i, _setting(p), None if prompt is None else len(prompt))
                                                for i, p, prompt, _ in batch_update.added),
                         ((a, b, d == MoveDirectionality.SWAP) for a, b, d in batch_update.moved))

    def apply(self, logits: torch.Tensor, ctx: object = None) -> torch.Tensor:
        return logits
