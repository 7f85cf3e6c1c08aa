"""``kvsieve.apply``: one call that routes a ``transformers`` model's attention through kvsieve
(a :class:`~kvsieve.integrations.transformers.KvsieveSession`, a context manager that restores the
model on exit)."""
from __future__ import annotations

from typing import Any

import torch

from ...sparse import SparseAttentionConfig
from .session import KvsieveSession

__all__ = ["apply"]


def apply(model: torch.nn.Module, selector: str | None = None, *, backend: str | None = None,
          layers: tuple[int, ...] | None = None, layer_types: tuple[str, ...] | None = None,
          dense_layers: tuple[int, ...] = (), phases: tuple[str, ...] | None = None, max_tokens: int = 8448,
          speculate: int | None = None, **params: Any) -> KvsieveSession:
    """Route ``model``'s attention through kvsieve with ``selector`` (its config fields as keyword
    arguments; ``None`` = dense); a context manager that restores the model on exit::

        with kvsieve.apply(model, "quest", budget=256):
            model.generate(input_ids, max_new_tokens=32)

    ``layers`` / ``layer_types`` / ``dense_layers`` / ``phases``: see :class:`SparseAttentionConfig`.
    ``speculate=K``: lossless sparse decoding (``docs/lossless.md``): ``model.generate`` drafts ``K``
    tokens per round with the selector and verifies them in one dense pass, so its tokens are dense
    decoding's (greedy) or follow dense decoding's distribution (sampling); a sliding-window model's
    windowed layers then keep their blocks (``release_windows=False``).
    ``model.generate`` keeps transformers' own cache (see the module docstring); the returned
    session also offers kvsieve's own paged-cache stepping (:meth:`KvsieveSession.generate`)."""
    config = None
    if selector is not None:
        config = SparseAttentionConfig(selector, params, dense_layers=tuple(dense_layers), phases=phases,
                                       layers=layers, layer_types=layer_types)
    else:
        given = {**params, "layers": layers, "layer_types": layer_types, "dense_layers": dense_layers or None,
                 "phases": phases}
        if any(v is not None for v in given.values()):
            raise ValueError(f"selector=None (dense) takes no selector settings, got "
                             f"{sorted(k for k, v in given.items() if v is not None)}")
    return KvsieveSession(model, config, backend=backend, max_tokens=max_tokens, speculate=speculate,
                          release_windows=speculate is None)
