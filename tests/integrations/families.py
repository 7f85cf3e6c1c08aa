"""Tiny random models built from transformers' own config classes, one per attention family
(seconds on CPU). Every sliding window is 8 positions unless a test asks for another, far below the test contexts."""
from __future__ import annotations

import copy

import torch

WINDOW = 8
_COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256)


def _config(family: str, window: int = WINDOW):
    import transformers as t

    if family == "llama":
        return t.LlamaConfig(**_COMMON)
    if family == "qwen2":  # layers >= max_window_layers use the window
        return t.Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=window, max_window_layers=2)
    if family == "qwen3":  # q/k norms
        return t.Qwen3Config(**_COMMON, head_dim=16)
    if family == "mistral":  # no layer_types: the window applies to every layer
        return t.MistralConfig(**_COMMON, sliding_window=window)
    if family == "gemma2":  # softcap 50, query_pre_attn_scalar scaling, alternating windows
        return t.Gemma2Config(**_COMMON, head_dim=16, sliding_window=window, query_pre_attn_scalar=24)
    if family == "gemma3":  # q/k norms, interleaved local/global with their own RoPE
        return t.Gemma3TextConfig(**_COMMON, head_dim=16, sliding_window=window, sliding_window_pattern=2)
    if family == "gpt_oss":  # learned sinks + alternating windows, MoE
        return t.GptOssConfig(**_COMMON, head_dim=16, sliding_window=window, num_local_experts=4,
                              num_experts_per_tok=2)
    if family == "deepseek_v3":  # MLA: decompressed K (nope + rope) 24 wide, V 16 wide
        return t.DeepseekV3Config(**{**_COMMON, "num_key_value_heads": 4}, kv_lora_rank=32, q_lora_rank=32,
                                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                                  num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
                                  moe_intermediate_size=32, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 10000.0})
    raise ValueError(family)


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "gpt_oss", "deepseek_v3")


def build(family: str, seed: int = 0, window: int = WINDOW):
    """``(model, reference)``: the same fp32 random weights; the reference runs transformers' eager
    attention (the only one of its own that implements softcap and sinks). ``window``: the sliding
    window of the families that have one."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = _config(family, window)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():  # random sinks/softcap-relevant scales so the features matter
        for m in model.modules():
            if hasattr(m, "sinks"):
                m.sinks.normal_(0.0, 2.0)
    ref = copy.deepcopy(model)
    return model, ref
