"""The DSA indexer's per-step input in a transformers session: each layer's hidden state.

A selector that reads :class:`~kvsieve.selectors.dsa.IndexerInputs` (``dsa``) needs the hidden state
its layer's attention module receives; :func:`attach_dsa_indexer` hands it down through the module's
call (the vLLM plug-in's twin is :mod:`kvsieve.integrations.vllm.indexer_feed`).
"""
from __future__ import annotations

from typing import Any

from ...selectors.dsa import IndexerInputs
from .hooks import MODEL_INPUTS_KWARG

__all__ = ["attach_dsa_indexer"]


def attach_dsa_indexer(session: Any) -> list[Any]:
    """Feed every selector of a :class:`KvsieveSession` that reads :class:`IndexerInputs` (``dsa``,
    or any selector declaring that ``model_inputs_type``) the hidden states of its attention
    module: a forward pre-hook per layer adds ``IndexerInputs(hidden=...)`` to the module's call as
    the keyword argument ``MODEL_INPUTS_KWARG`` when the layer's plan reads them, which the module
    passes on to kvsieve's attention function and that to the layer's step. Returns the hook
    handles (``.remove()`` to detach)."""
    handles = []
    for i, attn in enumerate(session.modules):
        def pre(mod, args, kwargs, i=i):  # noqa: ANN001, ANN202
            plan = session.layers[i].plan
            if plan is None or plan.selector.model_inputs_type is not IndexerInputs:
                return None
            hidden = kwargs["hidden_states"]
            return args, {**kwargs, MODEL_INPUTS_KWARG: IndexerInputs(hidden=hidden.reshape(-1, hidden.shape[-1]))}
        handles.append(attn.register_forward_pre_hook(pre, with_kwargs=True))
    return handles
