"""The vLLM engine processes of ``kvsieve eval --engine vllm``, seen from the sweep.

Each engine is one process of vLLM's environment running :mod:`.worker` (the plug-in's selector is
fixed per process): vLLM's own attention (plug-in off) or the plug-in with one selector entry's
config, the budget of each request set per request. Which Python runs them
(:func:`vllm_python`): ``--vllm-python`` / ``KVSIEVE_VLLM_PYTHON``, else this interpreter when it
imports vLLM, else the virtual environment ``.ci/run`` builds (``$KVSIEVE_CACHE/vllm-venv``). The
processes import kvsieve from the same checkout as the sweep (``PYTHONPATH``).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from ...cache_dir import default_cache_dir
from ...sparse import SparseAttentionConfig
from ..config import ConfigError

__all__ = ["ENV_PYTHON", "EngineError", "EngineProcess", "vllm_python", "plugin_config_file", "engine_env"]

ENV_PYTHON = "KVSIEVE_VLLM_PYTHON"
_WORKER = ["-m", "kvsieve.eval.served.worker"]
_CHECKOUT = str(Path(__file__).resolve().parents[3])  # the folder holding this kvsieve package


class EngineError(RuntimeError):
    """An engine process that exited, or a request it answered with an error."""


def vllm_python(explicit: str | None = None) -> str:
    """The Python that runs the engines (module docstring); a :class:`ConfigError` names what is missing."""
    given = explicit or os.environ.get(ENV_PYTHON)
    if given:
        if not Path(given).is_file():
            raise ConfigError(f"--engine vllm: the vLLM Python {given!r} (--vllm-python or {ENV_PYTHON}) does not exist")
        return given
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin is not None:  # not a namespace package of the same name
        return sys.executable
    venv = default_cache_dir() / "vllm-venv" / "bin" / "python"
    if venv.is_file():
        return str(venv)
    raise ConfigError(f"--engine vllm: vLLM is not importable in this Python ({sys.executable}) and no vLLM environment "
                      f"was found at {venv}; build it as .ci/run does (docs/vllm.md, 'Install and enable') or name its "
                      f"Python with --vllm-python or {ENV_PYTHON}")


def plugin_config_file(path: Path, sparse: SparseAttentionConfig, backend: str) -> Path:
    """Write the plug-in's ``KVSIEVE_CONFIG`` file for ``sparse`` (selector, params, dense layers,
    phases, backend) to ``path``, declaring ``prompt_settings``: the sweep gives every setting of a
    selector that selects in the prompt its own ``cache_salt`` (:func:`.protocol.cache_salt`)."""
    raw = {"selector": sparse.selector, "params": dict(sparse.params), "dense_layers": list(sparse.dense_layers),
           "phases": list(sparse.phases) if sparse.phases else None, "backend": backend, "prompt_settings": True}
    path.write_text(yaml.safe_dump({k: v for k, v in raw.items() if v is not None}, sort_keys=False), encoding="utf-8")
    return path


def engine_env(config_file: Path | None, threads: int, kv_cache_gib: int) -> dict[str, str]:
    """The environment of one engine: this one without the plug-in's settings, ``KVSIEVE_CONFIG``
    when ``config_file`` is given (``None``: vLLM's own attention), one process (no engine-core
    process), ``threads`` unbound OpenMP threads, kvsieve from this checkout, and
    ``VLLM_CPU_KVCACHE_SPACE`` (GiB) from this environment or ``kv_cache_gib``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSIEVE_SELECTOR", "KVSIEVE_CONFIG"))}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(threads),
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib)),
               PYTHONPATH=os.pathsep.join(filter(None, [_CHECKOUT, os.environ.get("PYTHONPATH")])))
    if config_file is not None:
        env["KVSIEVE_CONFIG"] = str(config_file)
    return env


class EngineProcess:
    """One engine process (:mod:`.worker`), started and waited for at construction; ``log``: its stderr."""

    def __init__(self, name: str, python: str, model_dir: str, *, dtype: str, max_model_len: int, max_num_seqs: int,
                 env: dict[str, str], log: Path) -> None:
        self.name, self.log = name, log
        cmd = [python, *_WORKER, "--model", model_dir, "--dtype", dtype, "--max-model-len", str(max_model_len),
               "--max-num-seqs", str(max_num_seqs)]
        self._stderr = open(log, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr, text=True)
        self._read("READY")

    def _read(self, prefix: str) -> str:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        code = self._proc.wait()
        self._stderr.flush()
        tail = self.log.read_text(encoding="utf-8", errors="replace")[-3000:]
        errors = [line for line in tail.splitlines() if "Error" in line]
        raise EngineError(f"engine {self.name!r}: the process exited ({code})" + (f": {errors[-1]}" if errors else "")
                          + f"; its log ({self.log}) ends:\n{tail}")

    def request(self, job: dict[str, Any]) -> dict[str, Any]:
        """Send one request (:mod:`.worker`) and return its reply; an error reply raises :class:`EngineError`."""
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(job) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass  # the process is gone: _read reports how it ended
        reply = json.loads(self._read("REPLY "))
        if "error" in reply:
            raise EngineError(f"engine {self.name!r}: {reply['error']}")
        return reply

    def close(self) -> None:
        """End the process (end of its input) and wait for it."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            try:
                self._proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self._proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._stderr.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
