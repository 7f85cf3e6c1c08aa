"""A ``model.generate`` call read for speculative decoding: the settings the draft-and-verify rule
honours exactly, every other one refused by name.

``transformers`` resolves the call's generation config itself
(``GenerationMixin._prepare_generation_config``: the call's ``generation_config`` or keyword
arguments over the model's ``generation_config`` over its global defaults), so the config read
here is the one its own ``generate`` would run. Honoured: greedy decoding (``do_sample=False``),
multinomial sampling (``do_sample=True``) with ``temperature``, ``top_k`` and ``top_p``
(:class:`~kvsieve.sparse.speculation.Sampling`, the same transform on the draft and the verify
logits), ``max_new_tokens`` / ``max_length``, ``eos_token_id`` and ``pad_token_id`` (rows that
finished are padded, generation stops when every row has). Refused, naming the field: any other
generation setting away from its neutral value (beams, repetition penalties, ``min_p``, minimum
lengths, ...: logits processors the rule would have to apply identically to both passes and
positions), logits processors, stopping criteria, streamers, assistant models and other
``generate`` arguments, an ``attention_mask`` with padding, and model keyword arguments.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...sparse.speculation import Sampling

__all__ = ["GenerateRequest", "read_generate_call"]

#: settings the speculative loop reads (the rest must keep their neutral values)
_HONOURED = frozenset({"max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "eos_token_id",
                       "pad_token_id", "bos_token_id", "use_cache"})
#: bookkeeping fields of a generation config, not settings
_BOOKKEEPING = frozenset({"transformers_version", "_from_model_config", "_commit_hash", "_original_object_hash"})
#: ``generate``'s own arguments besides the prompt and the config, all refused when given
_GENERATE_ARGS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus", "assistant_model",
                  "streamer", "negative_prompt_ids", "negative_prompt_attention_mask", "custom_generate")


@dataclass(frozen=True)
class GenerateRequest:
    """What a speculative ``generate`` runs: the prompt ``input_ids [B, S]``, ``max_new_tokens``,
    ``sampling`` (``None`` = greedy), the ``eos_token_ids`` that finish a row and the ``pad_token_id``
    that fills it afterwards (``None`` without eos)."""

    input_ids: torch.Tensor
    max_new_tokens: int
    sampling: Sampling | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None


def read_generate_call(model: Any, args: tuple, kwargs: dict[str, Any]) -> GenerateRequest:
    """The :class:`GenerateRequest` of ``model.generate(*args, **kwargs)``, or a ``ValueError``
    naming the first argument or setting speculative decoding cannot honour exactly."""
    if len(args) > 2:
        raise ValueError(f"speculate: generate takes the prompt and generation_config positionally; got {len(args)} "
                         "positional arguments")
    kwargs = dict(kwargs)
    given = [name for name in _GENERATE_ARGS if kwargs.pop(name, None) is not None]
    if given:
        raise ValueError(f"speculate: generate({given[0]}=...) is not supported with speculative decoding (the draft "
                         "and verify passes could not apply it identically)")
    ids = args[0] if args else kwargs.pop("inputs", None)
    ids = kwargs.pop("input_ids", None) if ids is None else ids
    config = args[1] if len(args) > 1 else kwargs.pop("generation_config", None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] < 1:
        raise ValueError(f"speculate: generate needs input_ids [batch, seq_len >= 1], got "
                         f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}")
    config, model_kwargs = model._prepare_generation_config(config, **kwargs)
    mask = model_kwargs.pop("attention_mask", None)
    if mask is not None and (mask.shape != ids.shape or not bool((mask == 1).all())):
        raise ValueError("speculate: attention_mask with padding; kvsieve sessions run equal-length rows without padding")
    if model_kwargs:
        raise ValueError(f"speculate: generate({sorted(model_kwargs)[0]}=...) is a model argument speculative "
                         "decoding does not pass on")
    neutral = {**type(config)().to_dict(), **model.generation_config._get_default_generation_params(),
               "output_attentions": False, "output_hidden_states": False}
    for name, value in sorted(config.to_dict().items()):
        if name not in _HONOURED | _BOOKKEEPING and value != neutral.get(name):
            raise ValueError(f"speculate: generation setting {name}={value!r} is not supported with speculative "
                             f"decoding (neutral: {neutral.get(name)!r}); the draft and verify passes apply only "
                             "temperature, top_k and top_p")
    new = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - ids.shape[1]
    if new < 1:
        raise ValueError(f"speculate: max_length={config.max_length} leaves no new token after a prompt of "
                         f"{ids.shape[1]}; set max_new_tokens")
    eos = config.eos_token_id
    eos_ids = () if eos is None else tuple(int(e) for e in ([eos] if isinstance(eos, int) else eos))
    pad = config.pad_token_id if config.pad_token_id is not None else (eos_ids[0] if eos_ids else None)
    sampling = Sampling(float(config.temperature), int(config.top_k or 0), float(config.top_p)) \
        if config.do_sample else None
    return GenerateRequest(ids, int(new), sampling, eos_ids, pad)
