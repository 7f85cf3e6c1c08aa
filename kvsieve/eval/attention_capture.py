"""The model run once with its attention captured, through transformers' attention interface (so
RoPE, norms and the model's scale are the model's): what the eval hands a calibration step
(:attr:`kvsieve.sparse.CalibrationContext.capture` and ``last_queries``) and measures mass recall with.

* :func:`capture_attention`: per chosen layer the attention-input hidden states, the queries of a
  few rows and every key (:class:`~kvsieve.sparse.calibration.LayerCapture`); the other sliding-window
  layers run :func:`windowed_attention`;
* :func:`last_query_capture`: per window and chosen layer the last query and every key and value,
  the rest of the model through transformers' SDPA attention.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..sparse.calibration import LayerCapture

__all__ = ["capture_attention", "last_query_capture", "release_free_heap", "windowed_attention"]

_CAPTURE = "kvsieve_distill_capture"
_LAST_QUERY = "kvsieve_capture"


@contextmanager
def _attention_function(model: torch.nn.Module, name: str, function: Callable[..., Any]) -> Iterator[None]:
    """``model`` runs ``function`` (registered as ``name``, with transformers' SDPA mask) as its
    attention, without gradients, until the block ends."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        with torch.no_grad():
            yield
    finally:
        model.set_attn_implementation(previous)


def windowed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int,
                       scaling: float | None) -> torch.Tensor:
    """Causal sliding-window attention of one sequence, in query chunks of ``window`` rows that each
    read only the ``2 * window - 1`` keys they can see: ``query [1, Hq, S, D]``, ``key``/``value
    [1, Hkv, S, D]`` -> ``[1, S, Hq, D]`` (the layout transformers' attention functions return).
    Position ``t`` attends ``s`` with ``t - window < s <= t`` (transformers' sliding mask); the cost
    is ``O(S * window)`` instead of the masked full ``O(S**2)``."""
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    s = query.shape[2]
    out = torch.empty_like(query)
    for c0 in range(0, s, window):
        c1, k0 = min(s, c0 + window), max(0, c0 - window + 1)
        qpos, kpos = torch.arange(c0, c1)[:, None], torch.arange(k0, c1)[None]
        mask = (kpos <= qpos) & (kpos > qpos - window)
        out[:, :, c0:c1] = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, c0:c1], key[:, :, k0:c1], value[:, :, k0:c1], attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous()


def capture_attention(model: torch.nn.Module, ids: torch.Tensor, layers: list[int], rows: torch.Tensor
                      ) -> dict[int, LayerCapture]:
    """Run the frozen model once over ``ids [1, S]``; per layer of ``layers`` its
    :class:`LayerCapture` at query ``rows``. Refuses a layer whose attention is not plain causal
    softmax (logit soft-capping, a sliding window). The other sliding-window layers run
    :func:`windowed_attention`. The forward pass's freed C heap goes back to the OS before
    returning (:func:`release_free_heap`), so that repeated captures stay at what they keep."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    hidden: dict[int, torch.Tensor] = {}
    found: dict[int, LayerCapture] = {}
    wanted = set(layers)

    def capture(module, query, key, value, attention_mask, **kwargs):
        i = getattr(module, "layer_idx", None)
        if i not in wanted and kwargs.get("sliding_window") and kwargs.get("softcap") is None:
            return windowed_attention(query, key, value, kwargs["sliding_window"], kwargs.get("scaling")), None
        if i in wanted:
            for name in ("softcap", "sliding_window"):
                if kwargs.get(name) is not None:
                    raise ValueError(f"distill: layer {i} attention has {name}={kwargs[name]}; only plain causal "
                                     "softmax attention is distilled")
            scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
            found[i] = LayerCapture(hidden[i], query[0][:, rows].transpose(0, 1).float(),
                                    key[0].transpose(0, 1).float(), float(scale))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def pre(mod, args, kwargs):
        hidden[mod.layer_idx] = kwargs["hidden_states"][0].detach().bfloat16()

    attns = [layer.self_attn for layer in model.get_decoder().layers]
    hooks = [attns[i].register_forward_pre_hook(pre, with_kwargs=True) for i in layers]
    try:
        with _attention_function(model, _CAPTURE, capture):
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    release_free_heap()
    return {i: found[i] for i in layers}


def release_free_heap() -> bool:
    """Hand the C heap's free memory back to the OS (glibc's ``malloc_trim``); False where the C
    library has none. A capture's forward pass frees far more than it keeps, and glibc keeps what
    is freed: on SmolLM2 at 2K each capture left about 0.3 GB resident where 86 MB is kept, 9.3 GB
    after 25 windows (docs/results/dsa.md, section 8.1); trimmed, each adds what it keeps."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


def last_query_capture(model: torch.nn.Module, windows: list[torch.Tensor], layers: set[int]
                       ) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], float]:
    """Per window ``[1, S]`` of ``windows`` and layer in ``layers``, the last query over the whole
    context: ``(q [1, Hq, D], k [S, Hkv, D], v [S, Hkv, D])`` as the model's attention function
    receives them (after RoPE and any norm); and those layers' softmax scale (one value; layers
    that differ are refused)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    samples, scales = [], set()

    def capture(module, query, key, value, attention_mask, **kwargs):
        if getattr(module, "layer_idx", None) is None:
            raise ValueError(f"last_query_capture: attention module {type(module).__name__} has no layer_idx")
        if module.layer_idx not in layers:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        samples.append((query[0, :, -1:].transpose(0, 1).float(), key[0].transpose(0, 1).float(),
                        value[0].transpose(0, 1).float()))
        scales.add(float(kwargs["scaling"]) if kwargs.get("scaling") is not None else query.shape[-1] ** -0.5)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    with _attention_function(model, _LAST_QUERY, capture):
        for ids in windows:
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
    if len(scales) != 1:
        raise ValueError(f"last_query_capture: the layers use different softmax scales {sorted(scales)}")
    return samples, scales.pop()
