"""kvsieve inside Hugging Face ``transformers``: ``kvsieve.apply(model, "quest", budget=256)``
(:func:`apply`) or a :class:`KvsieveSession` routes a decoder's attention through kvsieve's paged
cache, selectors and backends.

Modules: :mod:`.session` (the session: paged cache, engine, layer calls, reporting), :mod:`.steps`
(opening, closing and undoing a step), :mod:`.apply_model` (``kvsieve.apply``), :mod:`.hooks` (the
attention and mask functions registered with transformers), :mod:`.generate_link` (transformers'
own cache beside the paged cache under ``model.generate``), :mod:`.attention_features` (each
layer's window, softcap, sinks and scaling, read and checked), :mod:`.feature_backend` (those
features applied around any backend), :mod:`.golden_check` (spot checks against the Vanilla golden),
:mod:`.speculate` (lossless decoding: the selector drafts, a dense pass verifies) and
:mod:`.generate_args` (the ``generate`` settings it honours or refuses).
"""
from __future__ import annotations

from .apply_model import apply
from .feature_backend import gather_request_kv
from .hooks import ATTN_IMPLEMENTATION, MODEL_INPUTS_KWARG, register_attention
from .indexer_feed import attach_dsa_indexer
from .session import KvsieveSession, LayerObserver

__all__ = ["KvsieveSession", "apply", "attach_dsa_indexer", "ATTN_IMPLEMENTATION", "MODEL_INPUTS_KWARG", "register_attention",
           "LayerObserver", "gather_request_kv"]
