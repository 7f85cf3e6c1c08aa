"""kvsieve inside vLLM: a ``vllm.general_plugins`` plug-in that replaces vLLM's attention backend
with one that runs a kvsieve selector per layer over vLLM's own paged cache (see docs/vllm.md).

Enable it with ``KVSIEVE_SELECTOR="quest:budget=256"`` (or ``"dense"``) or ``KVSIEVE_CONFIG=file``,
or the vLLM way, ``--additional-config '{"kvsieve": {"selector": "quest", "budget": 256}}'``
(:mod:`.config`); with none of them vLLM runs its own attention. Every module, by when it runs:

* **Start-up** (once per process, before any step): :mod:`.plugin` (the entry point vLLM calls),
  :mod:`.config` (settings read from the environment or vLLM's additional config), :mod:`.startup` (every refusal, in the order a
  user meets them), :mod:`.state` (the process's plans, backend and the caches below, built when vLLM
  builds the first attention layer), :mod:`.layouts` (vLLM's cache tensors as K/V views).
* **Per request**: :mod:`.request_settings` (what a request may ask, checked at admission; the batch
  table of each row's setting and prompt length) and :mod:`.settings_processor` (the logits processor
  that carries both through vLLM's persistent batch).
* **Per step**: :mod:`.step` (vLLM's step tables -> a :class:`~.step.PreparedStep`: kvsieve's
  metadata, token order and row settings, once per step for every layer).
* **Per layer call**: :mod:`.router` (the one router: which named path a layer call takes),
  :mod:`.layer` (the selector path: the layer's selector, then each phase's rows on its path),
  :mod:`.setting_groups` (the selector per group of rows of one setting), :mod:`.host` (the host
  engine's own kernels, and kvsieve's native runs kernel, on the host's cache), :mod:`.native_decode`
  (the one-call decode path), :mod:`.indexer_feed` (each selecting layer's hidden state for DSA).
* **Adapters** (vLLM's backend classes, thin: vLLM's objects in, the router's path run):
  :mod:`.cpu` (``CPU_ATTN``) and :mod:`.cuda` (``TRITON_ATTN``, never run on a GPU).
* **Debug aids** (off by default): :mod:`.state_check` (``KVSIEVE_CHECK_STATE``: the selector's
  per-block state against a recomputation) and :mod:`.golden_capture` (``KVSIEVE_CAPTURE``: every
  selector-path call against kvsieve's Vanilla golden).
* **Offline**: :mod:`.convert` (SmolLM2 GGUF -> safetensors for vLLM).

Only :mod:`.plugin`, :mod:`.cpu`, :mod:`.cuda` and :mod:`.settings_processor` import vLLM
(:func:`.startup.worker_ranks` asks vLLM's parallel state when called, inside a vLLM process).
"""
from __future__ import annotations

__all__: list[str] = []
