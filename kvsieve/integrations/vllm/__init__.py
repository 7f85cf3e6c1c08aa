"""kvsieve inside vLLM: a ``vllm.general_plugins`` plug-in that replaces vLLM's attention backend
with one that runs a kvsieve selector per layer over vLLM's own paged cache (see docs/vllm.md).

Enable it with ``KVSIEVE_SELECTOR="quest:budget=256"`` (or ``"dense"``) or ``KVSIEVE_CONFIG=file``
(:mod:`.config`); with neither set the plug-in leaves vLLM untouched. Modules: :mod:`.config`
(settings and refusals), :mod:`.layouts` (vLLM cache tensors as K/V views), :mod:`.step` (vLLM
step -> kvsieve metadata, one layer's selector + backend), :mod:`.plugin` (the entry point),
:mod:`.cpu` / :mod:`.cuda` (vLLM backend classes), :mod:`.convert` (SmolLM2 GGUF -> safetensors),
:mod:`.request_settings` / :mod:`.setting_groups` (per-request settings: what a request may ask,
rows of several settings in one step) and :mod:`.settings_processor` (the logits processor that
carries them through vLLM's batch). Only :mod:`.plugin`, :mod:`.cpu`, :mod:`.cuda` and
:mod:`.settings_processor` import vLLM.
"""
from __future__ import annotations

__all__: list[str] = []
