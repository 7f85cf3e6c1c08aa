"""The GGUF conversion's lock (``integrations/vllm/convert.py``), without vLLM or a model: processes
converting one folder at once take turns, so the conversion runs once and the folder that the first
one finished is never deleted under the others."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from kvsieve.integrations.vllm import convert


def test_concurrent_conversions_convert_once_and_share_the_folder(tmp_path: Path, monkeypatch) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"x" * 10)
    out = tmp_path / "model-safetensors"
    calls: list[int] = []

    def slow_convert(gguf: Path, out_dir: Path, architecture: str, source: dict) -> None:
        calls.append(threading.get_ident())
        time.sleep(0.3)  # long enough for the other caller to arrive while this one converts
        out_dir.mkdir()
        (out_dir / "weights").write_text("done", encoding="utf-8")
        (out_dir / convert._MARKER).write_text(json.dumps(source), encoding="utf-8")

    monkeypatch.setattr(convert, "_convert", slow_convert)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(convert.convert_gguf(gguf, out))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [out] * 3
    assert len(calls) == 1  # the waiting callers found the folder finished
    assert (out / "weights").read_text(encoding="utf-8") == "done"


def test_a_stale_folder_is_converted_again(tmp_path: Path, monkeypatch) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"x" * 10)
    out = tmp_path / "model-safetensors"
    out.mkdir()
    (out / convert._MARKER).write_text(json.dumps({"gguf": "model.gguf", "size": 9}), encoding="utf-8")
    calls: list[dict] = []
    monkeypatch.setattr(convert, "_convert", lambda gguf, out_dir, architecture, source: calls.append(source))
    assert convert.convert_gguf(gguf, out) == out
    assert calls == [{"gguf": "model.gguf", "size": 10, "architecture": "LlamaForCausalLM"}]
