"""Per-layer plans: which layers a selector runs on, by layer type, by index, by explicit list."""
from __future__ import annotations

import pytest
from families import build

from kvsieve import SparseAttentionConfig, lower_config
from kvsieve.integrations.transformers import KvsieveSession

TYPES = ["sliding_attention", "full_attention"] * 3


def _on(plans) -> list[int]:
    return [i for i, p in enumerate(plans) if p is not None]


def test_interleaved_default_is_full_attention_layers_only() -> None:
    assert _on(lower_config(SparseAttentionConfig("quest"), num_layers=6, layer_types=TYPES)) == [1, 3, 5]


def test_uniform_models_run_every_layer() -> None:
    assert _on(lower_config(SparseAttentionConfig("quest"), num_layers=4)) == [0, 1, 2, 3]
    assert _on(lower_config(SparseAttentionConfig("quest"), num_layers=3,
                            layer_types=["sliding_attention"] * 3)) == [0, 1, 2]


def test_by_type_index_and_list() -> None:
    both = ("full_attention", "sliding_attention")
    assert _on(lower_config(SparseAttentionConfig("quest", layer_types=both), num_layers=6, layer_types=TYPES)) \
        == [0, 1, 2, 3, 4, 5]
    # Quest's published recipe: layers 0 and 1 stay dense
    assert _on(lower_config(SparseAttentionConfig("quest", dense_layers=(0, 1)), num_layers=4)) == [2, 3]
    assert _on(lower_config(SparseAttentionConfig("quest", layers=(0, -1)), num_layers=6, layer_types=TYPES)) \
        == [0, 5]


def test_errors_list_the_model_layer_types() -> None:
    with pytest.raises(ValueError, match=r"layer types are \['full_attention', 'sliding_attention'\]"):
        lower_config(SparseAttentionConfig("quest", layer_types=("chunked_attention",)), num_layers=6,
                     layer_types=TYPES)
    with pytest.raises(ValueError, match=r"layers \[0\] are not of layer_types"):
        lower_config(SparseAttentionConfig("quest", layers=(0,), layer_types=("full_attention",)), num_layers=6,
                     layer_types=TYPES)
    with pytest.raises(ValueError, match="layers entry 9"):
        lower_config(SparseAttentionConfig("quest", layers=(9,)), num_layers=6)


def test_session_passes_the_model_layer_types() -> None:
    model, _ = build("gemma3")  # sliding, full, sliding, full
    session = KvsieveSession(model, SparseAttentionConfig("quest", {"budget": 16}), max_tokens=32)
    assert [layer.plan is not None for layer in session.layers] == [False, True, False, True]
