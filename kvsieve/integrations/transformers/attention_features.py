"""What a transformers attention layer asks of its attention function, read once per layer and
checked on every call: honour it or refuse it by name.

transformers hands its attention function ``(module, query, key, value, attention_mask,
scaling=, dropout=, sliding_window=, softcap=, s_aux=, ...)``. :func:`read_layer_features` reads
what each layer will ask for from the model's config and modules when a session is built (so a
selector plan and a backend can be refused before any token runs); :func:`check_call` verifies
every call's keyword arguments against it and raises naming any argument kvsieve does not apply.

Honoured (see :class:`LayerFeatures`): sliding windows per layer (``config.layer_types`` +
``config.sliding_window``, or ``config.sliding_window`` on every layer when the config has no
``layer_types``, as Mistral), logit soft-capping (``attn_logit_softcapping``, Gemma 2),
learned attention sinks (``module.sinks``, GPT-OSS), the layer's own scaling
(``module.scaling``: Gemma's ``query_pre_attn_scalar``, DeepSeek's YaRN mscale). Q/K norms
(Qwen3, Gemma 3) and RoPE run in the module before the attention function: nothing to do here.

Refused: any other layer type (``chunked_attention``, ``linear_attention``, ...), chunked
attention (``attention_chunk_size``), non-causal layers, the model's own sparse indexer
(DeepSeek-V3.2's ``indexer`` / ``indices=``), dropout > 0, ``output_attentions``, and every
keyword argument not listed in :data:`IGNORED_KWARGS` or handled here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LayerFeatures", "read_layer_features", "check_call", "IGNORED_KWARGS", "KNOWN_LAYER_TYPES"]

#: layer types kvsieve implements (``config.layer_types`` entries)
KNOWN_LAYER_TYPES = ("full_attention", "sliding_attention")
#: keyword arguments that do not change the attention: positions are already applied (RoPE ran in
#: the module) and kvsieve keeps its own positions; cache and MoE flags concern other modules
IGNORED_KWARGS = frozenset({"position_ids", "cache_position", "use_cache", "output_router_logits"})


@dataclass(frozen=True)
class LayerFeatures:
    """One layer's attention semantics beyond plain causal softmax attention.

    ``layer_type``: ``"full_attention"`` or ``"sliding_attention"``; ``window``: a query at
    position ``i`` sees keys ``j`` with ``i - window < j <= i`` (transformers' convention),
    ``None`` = no window; ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the
    softmax; ``sinks``: ``[Hq]`` learned logits joining every query's softmax (their value is zero);
    ``scaling``: the softmax scale.
    """

    layer_type: str
    window: int | None
    softcap: float | None
    sinks: torch.Tensor | None
    scaling: float

    def describe(self) -> str:
        parts = [self.layer_type]
        if self.window is not None:
            parts.append(f"window {self.window}")
        if self.softcap is not None:
            parts.append(f"softcap {self.softcap}")
        if self.sinks is not None:
            parts.append("sinks")
        return ", ".join(parts)


def _layer_types(config: Any, num_layers: int) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types is None:
        sliding = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
        return ["sliding_attention" if sliding else "full_attention"] * num_layers
    types = list(types)
    if len(types) != num_layers:
        raise ValueError(f"config.layer_types has {len(types)} entries for {num_layers} decoder layers")
    unknown = sorted({t for t in types if t not in KNOWN_LAYER_TYPES})
    if unknown:
        raise ValueError(f"config.layer_types contains {unknown}, which kvsieve does not implement "
                         f"(it implements {list(KNOWN_LAYER_TYPES)})")
    return types


def read_layer_features(config: Any, modules: list[torch.nn.Module]) -> list[LayerFeatures]:
    """Every decoder layer's :class:`LayerFeatures`; raises naming the first config field or module
    attribute kvsieve cannot honour."""
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is not None:
        raise ValueError(f"config.attention_chunk_size={chunk}: chunked attention is not implemented by kvsieve")
    types = _layer_types(config, len(modules))
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in types and (not isinstance(window, int) or window < 1):
        raise ValueError(f"config.layer_types has sliding_attention layers but config.sliding_window={window!r}")
    softcap = getattr(config, "attn_logit_softcapping", None)
    out = []
    for i, (m, layer_type) in enumerate(zip(modules, types)):
        if getattr(m, "is_causal", True) is not True:
            raise ValueError(f"layer {i}: is_causal={m.is_causal}; kvsieve implements causal attention only")
        if hasattr(m, "indexer"):
            raise ValueError(f"layer {i}: {type(m).__name__} carries its own sparse indexer (module.indexer, "
                             "passed as indices=); kvsieve does not apply a model's own selection — run the "
                             "dense model (e.g. DeepSeek-V3) with kvsieve's 'dsa' selector instead")
        sinks = getattr(m, "sinks", None)
        if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.dim() != 1):
            raise ValueError(f"layer {i}: module.sinks must be a 1-D tensor [num_heads], got {type(sinks).__name__}")
        scaling = getattr(m, "scaling", None)
        if scaling is None:  # the module's own softmax scale is what transformers passes; no guessed default
            raise ValueError(f"layer {i}: {type(m).__name__} has no 'scaling' attribute, so kvsieve cannot know "
                             "the softmax scale its attention uses")
        cap = getattr(m, "attn_logit_softcapping", softcap)
        out.append(LayerFeatures(layer_type=layer_type, window=window if layer_type == "sliding_attention" else None,
                                 softcap=float(cap) if cap else None, sinks=sinks, scaling=float(scaling)))
    return out


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b))


def check_call(layer_idx: int, features: LayerFeatures, kwargs: dict[str, Any]) -> None:
    """Raise unless the call's keyword arguments ask for exactly ``features`` (what kvsieve applies)."""
    for name, value in kwargs.items():
        if name in IGNORED_KWARGS:
            continue
        if name == "scaling":
            if value is not None and not _same(float(value), features.scaling):
                raise ValueError(f"layer {layer_idx}: scaling={value} but the session was built with "
                                 f"{features.scaling} (module.scaling)")
        elif name == "dropout":
            if value:
                raise ValueError(f"layer {layer_idx}: dropout={value}; kvsieve attention has no dropout "
                                 "(put the model in eval mode)")
        elif name == "sliding_window":
            if value != features.window:
                raise ValueError(f"layer {layer_idx}: sliding_window={value} but the session planned "
                                 f"{features.window} for this {features.layer_type} layer")
        elif name == "softcap":
            if (value or None) != features.softcap:
                raise ValueError(f"layer {layer_idx}: softcap={value} but the session planned {features.softcap}")
        elif name == "s_aux":
            if value is not None and value is not features.sinks:
                raise ValueError(f"layer {layer_idx}: s_aux (attention sinks) is not this layer's module.sinks")
            if value is None and features.sinks is not None:
                raise ValueError(f"layer {layer_idx}: the layer has module.sinks but the call passed s_aux=None")
        elif name == "output_attentions":
            if value:
                raise ValueError(f"layer {layer_idx}: output_attentions=True; kvsieve returns no attention weights")
        else:
            raise ValueError(f"layer {layer_idx}: attention argument {name}={_short(value)} is not understood by "
                             "kvsieve; refusing rather than ignoring it")


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)}>"
    return repr(value)[:60]
