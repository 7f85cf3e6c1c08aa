"""Every attention feature kvsieve cannot honour is refused by name, and a refusal leaves the
model as it was (its attention implementation unchanged)."""
from __future__ import annotations

import pytest
import torch
from families import build

from kvsieve import SparseAttentionConfig
from kvsieve.integrations.transformers import KvsieveSession
from kvsieve.integrations.transformers.hooks import ATTN_IMPLEMENTATION, attention_forward


def _call(session: KvsieveSession, layer: int, **kwargs):
    m = session.modules[layer]
    q = torch.zeros(1, 4, 2, session.key_dim)
    kv = torch.zeros(1, session.layers[layer].geometry.num_kv_heads, 2, session.key_dim)
    return attention_forward(m, q, kv, kv, None, **kwargs)


@pytest.mark.parametrize("kwargs,name", [
    ({"scaling": 0.25, "unknown_flag": True}, "unknown_flag"),
    ({"scaling": 0.25, "indices": None}, "indices"),
    ({"scaling": 0.5}, "scaling"),
    ({"scaling": 0.25, "dropout": 0.1}, "dropout"),
    ({"scaling": 0.25, "sliding_window": 8}, "sliding_window"),
    ({"scaling": 0.25, "softcap": 30.0}, "softcap"),
    ({"scaling": 0.25, "s_aux": torch.zeros(4)}, "s_aux"),
    ({"scaling": 0.25, "output_attentions": True}, "output_attentions"),
])
def test_call_kwargs_not_understood_raise_by_name(kwargs, name) -> None:
    model, _ = build("llama")
    session = KvsieveSession(model, None, max_tokens=32)
    with pytest.raises(ValueError, match=name):
        _call(session, 0, **kwargs)
    assert not session._step_open and session.cache.request_ids == []


def test_wrong_window_for_the_layer_raises() -> None:
    model, _ = build("gemma3")  # layer 0 sliding (8), layer 1 full
    session = KvsieveSession(model, None, max_tokens=32)
    with pytest.raises(ValueError, match="sliding_window=None"):
        _call(session, 0, scaling=session.features[0].scaling, sliding_window=None)
    with pytest.raises(ValueError, match="sliding_window=16"):
        _call(session, 1, scaling=session.features[1].scaling, sliding_window=16)


def _refused(model: torch.nn.Module, match: str, **kwargs) -> None:
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=match):
        KvsieveSession(model, kwargs.pop("config", None), max_tokens=32, **kwargs)
    assert model.config._attn_implementation == before != ATTN_IMPLEMENTATION


def test_unknown_layer_type_refused() -> None:
    model, _ = build("qwen3")
    model.config.layer_types = ["full_attention", "linear_attention", "full_attention", "full_attention"]
    _refused(model, "linear_attention")


def test_module_without_its_softmax_scale_refused() -> None:
    model, _ = build("llama")
    attn = model.model.layers[0].self_attn
    del attn.scaling
    _refused(model, "no 'scaling' attribute")


def test_chunked_attention_refused() -> None:
    model, _ = build("llama")
    model.config.attention_chunk_size = 8
    _refused(model, "attention_chunk_size")


def test_softcap_refused_by_kernel_backends() -> None:
    model, _ = build("gemma2")
    _refused(model, "soft-capping.*attn_logit_softcapping=50.0", backend="triton")


def test_skip_softmax_refused_on_softcap_layers() -> None:
    model, _ = build("gemma2")
    _refused(model, "soft-caps", backend="torch",
             config=SparseAttentionConfig("skip_softmax", {"threshold_scale_factor_context": 1.0}, layer_types=("full_attention",)))


def test_evicting_selector_refused_on_windowed_layers() -> None:
    model, _ = build("mistral")
    _refused(model, "evicts prompt tokens.*sliding-window", config=SparseAttentionConfig("snapkv", {"prompt_budget": 16, "window_size": 4}))


def test_model_own_indexer_refused() -> None:
    import transformers as t

    cfg = t.DeepseekV32Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32,
                              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                              num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
                              moe_intermediate_size=32, index_topk=8, index_n_heads=2, index_head_dim=16)
    model = t.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    _refused(model, "indexed_attention")


def test_padding_mask_refused() -> None:
    model, _ = build("llama")
    KvsieveSession(model, None, max_tokens=32)
    ids = torch.randint(3, 96, (1, 6))
    with pytest.raises(ValueError, match="padding"):
        model(ids, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]]))
