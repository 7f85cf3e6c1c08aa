"""The DSA indexer's per-step input inside vLLM: each selecting layer's hidden state, taken through
the model's own modules.

vLLM's attention backend receives q, k, v and the cache, never the hidden state the lightning
indexer projects (:class:`~kvsieve.selectors.dsa.IndexerInputs`). The model's attention module
(``LlamaAttention``, ``Gemma3Attention``, ...: the parent of vLLM's ``Attention`` layer) is called
by its decoder layer as ``self_attn(positions=..., hidden_states=...)`` with the normalized input of
the layer, which is exactly what kvsieve's own engine hands the indexer (the ``hidden_states`` of
the transformers attention module). :class:`IndexerFeed` puts a forward pre-hook on each such
module whose layer reads the indexer; the hook keeps the tensor for that layer, and the layer's
attention call (same forward, a few lines later) takes it (:meth:`IndexerFeed.take`).

The modules are found on the first model forward of the process (vLLM's profiling run, before any
request): a global forward pre-hook (``torch.nn.modules.module.register_module_forward_pre_hook``)
waits for the first module that holds one of the plug-in's attention layers, hooks its attention
modules and removes itself. Every error here is raised then, at start-up, naming the layer: a model
that passes the hidden state otherwise than as the ``hidden_states`` keyword, or a selecting layer
whose parent module was not found.

This is a hand-over through the process's plug-in state, not a return value: vLLM's model code
calls the attention layer and cannot pass anything else through. It is only right when the model
runs eagerly (a traced graph would replay the hand-over after the attention op), so the plug-in
refuses compiled models for such selectors (:class:`~.state.PluginState`).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["IndexerFeed"]


class IndexerFeed:
    """Hands each selecting layer's hidden state ``[T, hidden_size]`` (vLLM's token order, ``T`` =
    the padded tokens of the step) from its attention module to its attention call.

    ``layers``: the global indices of the layers whose plan reads :class:`IndexerInputs`;
    ``is_plugin_layer(module)``: whether a module is one of vLLM's attention layers run by the plug-in
    (the backend's impl); ``layer_index(module)``: its global layer index (from vLLM's layer name);
    ``on_found(layers)``: called with the hooked layers when they are found (a check that may raise)."""

    def __init__(self, layers: set[int], is_plugin_layer: Callable[[nn.Module], bool],
                 layer_index: Callable[[nn.Module], int],
                 on_found: Callable[[frozenset[int]], None] | None = None) -> None:
        self.layers = frozenset(layers)
        self._is_plugin_layer, self._layer_index, self._on_found = is_plugin_layer, layer_index, on_found
        self._pending: dict[int, torch.Tensor] = {}
        self._handles: list = []
        self.hooked: frozenset[int] = frozenset()
        self._finder = nn.modules.module.register_module_forward_pre_hook(self._find)

    def _find(self, module: nn.Module, args: tuple) -> None:
        """Global pre-hook: on the first module holding plug-in attention layers, hook the parents
        of those that read the indexer, then stop looking."""
        parents = {self._layer_index(child): parent for parent in module.modules()
                   for child in parent.children() if self._is_plugin_layer(child)}
        if not parents:
            return
        self._finder.remove()
        wanted = {i: m for i, m in parents.items() if i in self.layers}
        for i, parent in sorted(wanted.items()):
            self._handles.append(parent.register_forward_pre_hook(self._keeper(i), with_kwargs=True))
        self.hooked = frozenset(wanted)
        if self._on_found is not None:
            self._on_found(self.hooked)

    def _keeper(self, layer_idx: int) -> Callable:
        def keep(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = kwargs.get("hidden_states")
            if not isinstance(hidden, torch.Tensor):
                raise NotImplementedError(
                    f"kvsieve vLLM plug-in: layer {layer_idx}'s attention module {type(module).__name__} was called "
                    "without a hidden_states keyword tensor; the DSA indexer reads the layer's hidden state from it, "
                    "so this model cannot serve a selector that reads IndexerInputs")
            self._pending[layer_idx] = hidden
        return keep

    def take(self, layer_idx: int, num_tokens: int, padded_tokens: int) -> torch.Tensor:
        """The layer's hidden state of this forward, ``[num_tokens, hidden_size]`` in vLLM's token
        order (the model's dtype); consumed (a second take in the same forward raises).
        ``padded_tokens``: the rows of the layer's query, which the hidden state must match."""
        hidden = self._pending.pop(layer_idx, None)
        if hidden is None:
            why = ("its attention module was not found in the model" if layer_idx not in self.hooked
                   else "its attention module did not run before its attention in this forward")
            raise RuntimeError(f"kvsieve vLLM plug-in: layer {layer_idx} reads the DSA indexer's hidden state, but "
                               f"{why}")
        flat = hidden.reshape(-1, hidden.shape[-1])
        if flat.shape[0] != padded_tokens:
            raise RuntimeError(f"kvsieve vLLM plug-in: layer {layer_idx}'s hidden state has {flat.shape[0]} rows, its "
                               f"attention call {padded_tokens}")
        return flat[:num_tokens]

    def close(self) -> None:
        """Remove every hook (the finder too, if it is still waiting)."""
        self._finder.remove()
        for h in self._handles:
            h.remove()
        self._handles.clear()
