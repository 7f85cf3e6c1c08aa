"""kvsieve's hooks in ``transformers``: the attention function and mask function it registers
under the name :data:`ATTN_IMPLEMENTATION`, and what a session reads of a model to attach them
(its attention modules, the head dims transformers hands over). The attention function finds the
layer's :class:`~kvsieve.integrations.transformers.KvsieveSession` on the module
(:data:`SESSION_ATTR`) and runs the layer there; see :mod:`kvsieve.integrations.transformers`.
"""
from __future__ import annotations

from typing import Any

import torch

from .attention_features import check_call

__all__ = ["ATTN_IMPLEMENTATION", "MODEL_INPUTS_KWARG", "SESSION_ATTR", "attention_forward", "attention_modules",
           "head_dims", "register_attention"]

#: the attention implementation's name (``model.set_attn_implementation``)
ATTN_IMPLEMENTATION = "kvsieve"
#: attention keyword argument carrying the layer's per-step model inputs for its selector (see the module docstring)
MODEL_INPUTS_KWARG = "kvsieve_model_inputs"
#: the attribute of an attention module holding its session
SESSION_ATTR = "kvsieve_session"

def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract; returns ``(out [B, S, Hq, D], None)``."""
    session = getattr(module, SESSION_ATTR, None)
    if session is None:
        raise RuntimeError(f"attention implementation {ATTN_IMPLEMENTATION!r} needs a KvsieveSession built on "
                           "this model (KvsieveSession(model, config))")
    if attention_mask is not None:
        raise ValueError(f"layer {module.layer_idx}: an attention_mask reached kvsieve's attention; kvsieve "
                         "applies causality and windows itself and cannot apply another mask")
    model_inputs = kwargs.pop(MODEL_INPUTS_KWARG, None)
    check_call(module.layer_idx, session.features[module.layer_idx], {"scaling": scaling, "dropout": dropout, **kwargs})
    return session._attend(module.layer_idx, query, key, value, model_inputs), None


def _no_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> None:
    """Mask function for ``AttentionMaskInterface``: kvsieve masks causally (and by window) from its
    ledger. A padding mask that hides any position is refused: rows are equal-length, unpadded."""
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("attention_mask hides positions (padding); kvsieve runs equal-length rows without "
                         "padding — pass unpadded rows of equal length")
    return None


def register_attention() -> None:
    """Register ``"kvsieve"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)


def head_dims(cfg: Any) -> tuple[int, int]:
    """(key/query head dim, value head dim) of the tensors transformers hands the attention function."""
    if hasattr(cfg, "kv_lora_rank"):  # MLA: decompressed nope + rope keys, separate value width
        key = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        return key, cfg.v_head_dim
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return head_dim, head_dim


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers' attention modules (``model.get_decoder().layers[i].self_attn``)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise ValueError(f"model: expected a decoder with .layers[i].self_attn, got {type(model).__name__}")
    return [layer.self_attn for layer in layers]
