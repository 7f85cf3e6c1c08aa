"""transformers' own cache beside kvsieve's paged cache, when ``model.generate`` drives the model.

``model.generate`` keeps a transformers ``Cache`` and hands the attention function the whole
history; kvsieve attends its own paged cache. :class:`GenerateLink` keeps the two in step:

* a forward pre-hook checks each transformers-driven forward before any layer runs. A forward
  whose cache holds no positions starts new requests. A forward continuing a cache
  (``cache=``, formerly ``past_key_values=``) is accepted only if it is the cache the session's
  previous forward returned and it holds as many positions as the session; any other cache (built before the session, by
  another session, cropped, or filled outside it) is refused, naming it, since its positions are
  not in the paged cache. A forward with ``use_cache=False`` whose rows extend the previous
  forward's rows (``generate(use_cache=False)`` recomputing the whole sequence each step) is
  refused when a layer's plan selects in the generation phase: every such forward is a prefill, so
  the selector would never run at decode.
* a forward hook records the cache each forward returns;
* ``model._reorder_cache`` (which transformers' beam search calls with ``beam_idx`` between
  steps) reorders transformers' cache as before and the paged cache's rows the same way
  (:meth:`~kvsieve.metadata.KVCacheManager.reorder`: blocks shared by reference, copied on write);
* ``model.generate`` tells the session the call's beam width (``num_beams``, from its keyword
  arguments or generation config) for the call's duration: its decode steps run the rows as
  groups of that many beams (:attr:`~kvsieve.metadata.AttentionMetadata.beam_width`, the
  block-offset table's layout), and rows that are not whole beam groups are refused;
  a session built with ``speculate=K`` decodes the call itself instead
  (:meth:`~kvsieve.integrations.transformers.speculate.SessionSpeculation.generate_call`: the
  selector drafts, a dense pass verifies).

:meth:`GenerateLink.close` removes all four.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["GenerateLink"]


class GenerateLink:
    """Hooks on ``model`` that tie transformers' generate loop to a session (see the module docstring).

    ``session`` exposes ``active`` (the model's attention runs through it now), ``driven`` (a
    session-driven forward is running), ``num_cached_positions``,
    ``live_rows``, ``decode_phase_selectors()``, ``reorder_rows(beam_idx)``, a settable ``beam_width``,
    ``speculate`` and ``generate_call(args, kwargs)``."""

    def __init__(self, model: torch.nn.Module, session: Any) -> None:
        self.model = model
        self.session = session
        self._cache: object | None = None  # the cache the last transformers-driven forward returned
        self._rows: torch.Tensor | None = None  # the last use_cache=False forward's input ids
        self._pre = model.register_forward_pre_hook(self._before, with_kwargs=True)
        self._post = model.register_forward_hook(self._after, with_kwargs=True)
        self._own_reorder = "_reorder_cache" in vars(model)
        self._previous_reorder: Callable[..., Any] | None = getattr(model, "_reorder_cache", None)
        model._reorder_cache = self._reorder
        self._own_generate = "generate" in vars(model)
        self._previous_generate: Callable[..., Any] = model.generate
        model.generate = self._generate

    def close(self) -> None:
        self._pre.remove()
        self._post.remove()
        if self._own_reorder:
            self.model._reorder_cache = self._previous_reorder
        else:
            del self.model._reorder_cache
        if self._own_generate:
            self.model.generate = self._previous_generate
        else:
            del self.model.generate

    def _generate(self, *args: Any, **kwargs: Any) -> Any:
        """``model.generate`` with the session's ``beam_width`` set to the call's ``num_beams``, or
        the session's speculative decoding of the call."""
        if self.session.speculate is not None and self.session.active:
            return self.session.generate_call(args, kwargs)
        config = kwargs.get("generation_config", args[1] if len(args) > 1 else None) or self.model.generation_config
        width = kwargs.get("num_beams", getattr(config, "num_beams", None)) or 1
        before = self.session.beam_width
        self.session.beam_width = int(width)
        try:
            return self._previous_generate(*args, **kwargs)
        finally:
            self.session.beam_width = before

    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        s = self.session
        if s.driven or not s.active:
            return
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5 renamed past_key_values
        held = cache.get_seq_length() if cache is not None else 0
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(self.model.config, "use_cache", True)
        if held:
            if cache is not self._cache or held != s.num_cached_positions or not s.live_rows:
                raise ValueError(
                    f"cache (past_key_values): a {type(cache).__name__} holding {held} positions that this kvsieve session "
                    f"did not build (the session holds {s.num_cached_positions} positions of {s.live_rows} rows, "
                    "and attends only its own paged cache); start generation from the prompt inside the session")
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not use_cache and isinstance(ids, torch.Tensor):
            prev, self._rows = self._rows, ids.detach().clone()
            extends = (prev is not None and prev.shape[0] == ids.shape[0] and ids.shape[1] > prev.shape[1]
                       and bool((ids[:, : prev.shape[1]] == prev).all()))
            names = s.decode_phase_selectors()
            if extends and names:
                raise ValueError(
                    f"use_cache=False: this forward recomputes the {prev.shape[1]} positions of the previous one plus "
                    f"{ids.shape[1] - prev.shape[1]} new (generate(use_cache=False)); every such step is a prefill, so "
                    f"the decode-phase selector(s) {names} would never select; generate with use_cache=True or "
                    "through the session (KvsieveSession.generate)")
        else:
            self._rows = None

    def _after(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if self.session.active and not self.session.driven:
            self._cache = getattr(output, "cache", None)

    def _reorder(self, cache: Any, beam_idx: torch.Tensor) -> Any:
        """transformers' beam-search hook: reorder its cache, then the session's rows alike."""
        if self._previous_reorder is not None:
            cache = self._previous_reorder(cache, beam_idx)
        else:
            cache.reorder_cache(beam_idx)
        if self.session.active:
            self.session.reorder_rows(beam_idx)
        return cache
