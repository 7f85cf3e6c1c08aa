"""Which layers a selector runs on: by layer type, by index, or by explicit list.

A model's layers have types (transformers' ``config.layer_types``: ``"full_attention"``,
``"sliding_attention"``); a model without them has only ``"full_attention"`` layers.
:func:`sparse_layers` resolves a :class:`~kvsieve.sparse.config.SparseAttentionConfig`'s
``layers`` / ``layer_types`` / ``dense_layers`` into the set of layer indices that run the selector:

* ``layers`` (explicit indices, negative from the end): exactly these; ``None`` = every layer
  whose type is selected;
* ``layer_types``: the types the selector runs on; ``None`` = ``("full_attention",)`` when the
  model interleaves full and other layers (windowed layers already attend a few hundred tokens),
  else every layer;
* ``dense_layers`` (indices) are then removed (Quest's published recipe keeps layers 0 and 1 dense).
"""
from __future__ import annotations

from collections.abc import Sequence

__all__ = ["sparse_layers"]


def _indices(name: str, values: Sequence[int], num_layers: int) -> set[int]:
    out = set()
    for i in values:
        if not -num_layers <= i < num_layers:
            raise ValueError(f"{name} entry {i} is outside [-{num_layers}, {num_layers})")
        out.add(i % num_layers)
    return out


def sparse_layers(*, num_layers: int, model_layer_types: Sequence[str] | None, layers: Sequence[int] | None,
                  layer_types: Sequence[str] | None, dense_layers: Sequence[int]) -> set[int]:
    """Indices of the layers that run the selector; raises naming the model's layer types when
    ``layer_types`` asks for one the model does not have."""
    types = list(model_layer_types) if model_layer_types is not None else ["full_attention"] * num_layers
    if len(types) != num_layers:
        raise ValueError(f"model_layer_types has {len(types)} entries for {num_layers} layers")
    present = sorted(set(types))
    if layer_types is not None:
        missing = sorted(set(layer_types) - set(present))
        if missing or not layer_types:
            raise ValueError(f"layer_types {list(layer_types)}: the model's layer types are {present}")
        wanted = set(layer_types)
    elif len(present) > 1 and "full_attention" in present:
        wanted = {"full_attention"}
    else:
        wanted = set(present)
    chosen = {i for i, t in enumerate(types) if t in wanted}
    if layers is not None:
        explicit = _indices("layers", layers, num_layers)
        if layer_types is not None and explicit - chosen:
            raise ValueError(f"layers {sorted(explicit - chosen)} are not of layer_types {sorted(wanted)} "
                             f"(their types: {[types[i] for i in sorted(explicit - chosen)]})")
        chosen = explicit
    return chosen - _indices("dense_layers", dense_layers, num_layers)
