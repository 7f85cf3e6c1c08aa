"""The one launcher of vLLM engine processes with the kvsieve plug-in: the served eval
(``kvsieve eval --engine vllm``) and every ``benchmarks/vllm_*`` script start their engines here.

A process runs in one **mode** (the plug-in is configured per process): ``own`` (vLLM's own
attention, the plug-in off), a ``.yaml`` / ``.yml`` / ``.json`` file (``KVSIEVE_CONFIG``) or any
other ``KVSIEVE_SELECTOR`` string (``dense``, ``quest:budget=256``, ...), optionally followed by
``@K``: the lossless mode, the selector drafting ``K`` tokens a step through kvsieve's drafter and
vLLM verifying them (:func:`split_speculation`, :meth:`EngineLaunch.speculative_config`;
docs/lossless.md). :class:`EngineLaunch`
holds a mode and the process's settings and builds its environment by one rule
(:meth:`EngineLaunch.env`); :func:`model_folder` names the checkpoint folder vLLM loads;
:func:`vllm_python` the Python that runs vLLM. Two kinds of process: a script of the caller's
speaking a line protocol on stdin / stdout, vLLM's offline engine inside it
(:class:`EngineProcess`), or vLLM's OpenAI-compatible server (:func:`openai_server`). Nothing here
imports vLLM.
"""
from __future__ import annotations

import http.client
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...cache_dir import default_cache_dir
from ...integrations.vllm.config import (ENV_BACKEND, ENV_CAPTURE, ENV_CHECK_STATE, ENV_CONFIG, ENV_PROMPT_SETTINGS,
                                         ENV_SELECTOR)
from ...integrations.vllm.draft_steps import DRAFTER
from ..config import ConfigError
from ..model import checkpoint_folder, models_dir

__all__ = ["OWN", "DENSE", "ENV_PYTHON", "KV_SPACE", "EngineError", "EngineLaunch", "EngineProcess", "default_threads",
           "drafter_config",
           "healthy", "model_folder", "openai_server", "split_speculation", "vllm_python"]

OWN = "own"
DENSE = "dense"  # the plug-in on, no selector
ENV_PYTHON = "KVSIEVE_VLLM_PYTHON"
KV_SPACE = "VLLM_CPU_KVCACHE_SPACE"
#: every setting the plug-in reads from its environment: a launched process gets its mode's alone
PLUGIN_SETTINGS = (ENV_SELECTOR, ENV_CONFIG, ENV_BACKEND, ENV_CAPTURE, ENV_CHECK_STATE, ENV_PROMPT_SETTINGS)
CHECKOUT = str(Path(__file__).resolve().parents[3])  # the folder holding this kvsieve package
_CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def split_speculation(mode: str) -> tuple[str, int | None]:
    """``"quest:budget=512@4"`` -> ``("quest:budget=512", 4)``; a mode without ``@`` -> ``(mode, None)``.
    A suffix that is not a whole number >= 1, or one on ``own`` / ``dense`` (no selector to draft
    with), is refused naming the mode."""
    base, mark, k = mode.rpartition("@")
    if not mark:
        return mode, None
    if not k.isdigit() or int(k) < 1:
        raise ValueError(f"mode {mode!r}: the draft length after '@' must be a whole number >= 1, got {k!r}")
    if base in (OWN, DENSE, ""):
        raise ValueError(f"mode {mode!r}: {base or 'an empty mode'!r} has no selector to draft with; "
                         "write <selector>@K")
    return base, int(k)


def drafter_config(k: int) -> dict[str, Any]:
    """vLLM's ``speculative_config`` naming kvsieve's drafter, ``k`` draft tokens a step (docs/lossless.md)."""
    return {"method": "custom_class", "model": DRAFTER, "num_speculative_tokens": k}


class EngineError(RuntimeError):
    """An engine process that exited, or a request it answered with an error."""


def vllm_python(explicit: str | None = None) -> str:
    """The Python that runs vLLM: ``explicit`` (``--vllm-python``) or ``KVSIEVE_VLLM_PYTHON``, else this
    interpreter when it imports vLLM, else the virtual environment ``.ci/run`` builds
    (``$KVSIEVE_CACHE/vllm-venv``); a :class:`ConfigError` names what is missing."""
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


def model_folder(spec: str) -> Path:
    """The checkpoint folder vLLM loads for ``spec``: the one kvsieve's transformers path loads
    (:func:`kvsieve.eval.model.checkpoint_folder`: a built-in name or a ``.gguf`` file, converted
    once to fp32 under ``$KVSIEVE_CACHE/models``, or a folder with ``config.json``), so both engines
    run the same weights. A built-in whose package this Python lacks is a :class:`ConfigError`."""
    try:
        return checkpoint_folder(spec)
    except FileNotFoundError as err:
        raise ConfigError(f"model {spec!r}: {err}; install it in this environment ({sys.executable}), or give the "
                          f"converted folder (kvsieve's load_model writes it under {models_dir()})") from None


def default_threads() -> int:
    """The environment's ``OMP_NUM_THREADS``, else 1."""
    return int(os.environ.get("OMP_NUM_THREADS", "1"))


@dataclass(frozen=True)
class EngineLaunch:
    """One engine process's mode and settings (module docstring). ``threads``: N unbound OpenMP
    threads (``VLLM_CPU_OMP_THREADS_BIND=nobind``), ``None``: the environment's settings as they are
    (vLLM binds its threads itself where the environment sets nothing). ``kv_cache_gib``: vLLM's CPU
    KV space in GiB (``VLLM_CPU_KVCACHE_SPACE``; a value the environment sets wins, a machine's
    limit), ``None``: the variable removed (the engine sizes its cache itself, e.g. by
    ``kv_cache_memory_bytes``). ``check_state``: the plug-in's per-step state check
    (``KVSIEVE_CHECK_STATE=1``, docs/vllm.md)."""

    mode: str = OWN
    threads: int | None = None
    kv_cache_gib: int | None = None
    check_state: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str) or not self.mode:
            raise ValueError(f"EngineLaunch.mode must be {OWN!r}, a selector string or a config file, got {self.mode!r}")
        split_speculation(self.mode)
        for name in ("threads", "kv_cache_gib"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"EngineLaunch.{name} must be an int >= 1 or None, got {value!r}")

    def kv_space_gib(self, base: Mapping[str, str] | None = None) -> int | None:
        """The KV space the process gets (GiB): ``base``'s (default: this process's environment)
        ``VLLM_CPU_KVCACHE_SPACE`` where set and :attr:`kv_cache_gib` is not ``None``, else
        :attr:`kv_cache_gib`; a value that is not a whole number of GiB is refused, naming it."""
        given = (os.environ if base is None else base).get(KV_SPACE)
        if self.kv_cache_gib is None or given is None:
            return self.kv_cache_gib
        if not given.isdigit() or int(given) < 1:
            raise ConfigError(f"{KV_SPACE}={given!r} in the environment: expected a whole number of GiB >= 1")
        return int(given)

    def env(self, *, server: bool = False, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The process's environment: ``base`` (default: this process's) without the plug-in's
        settings (:data:`PLUGIN_SETTINGS`), kvsieve imported from this checkout (``PYTHONPATH``),
        the engine in the same process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) unless ``server`` (the
        OpenAI server runs its engine core in a process of its own), then the threads, the KV space,
        the state check and the mode (class docstring)."""
        base = os.environ if base is None else base
        env = {k: v for k, v in base.items() if k not in PLUGIN_SETTINGS and k != KV_SPACE}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [CHECKOUT, base.get("PYTHONPATH")]))
        if not server:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if self.threads is not None:
            env.update(OMP_NUM_THREADS=str(self.threads), VLLM_CPU_OMP_THREADS_BIND="nobind")
        kv = self.kv_space_gib(base)
        if kv is not None:
            env[KV_SPACE] = str(kv)
        if self.check_state:
            env[ENV_CHECK_STATE] = "1"
        plugin = split_speculation(self.mode)[0]
        if plugin.endswith(_CONFIG_SUFFIXES):
            env[ENV_CONFIG] = plugin
        elif plugin != OWN:
            env[ENV_SELECTOR] = plugin
        return env

    def speculative_config(self) -> dict[str, Any] | None:
        """vLLM's ``speculative_config`` for a ``<selector>@K`` mode (kvsieve's drafter, ``K`` draft
        tokens a step), ``None`` for any other."""
        k = split_speculation(self.mode)[1]
        return None if k is None else drafter_config(k)


class EngineProcess:
    """One engine process running ``cmd`` with ``env`` (:meth:`EngineLaunch.env`), stderr to ``log``,
    started and waited for at construction (its first stdout line starting with ``ready``). It then
    reads lines on stdin (:meth:`send`) and answers on stdout (:meth:`read`); end of input ends it."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path, *, ready: str = "READY") -> None:
        self.name, self.log = name, log
        self._stderr = open(log, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr, text=True)
        self.read(ready)

    def read(self, prefix: str) -> str:
        """The rest of the next stdout line starting with ``prefix`` (other lines are skipped); an
        :class:`EngineError` with the end of the log when the process exits first."""
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        code = self._proc.wait()
        self._stderr.flush()
        tail = self.log.read_text(encoding="utf-8", errors="replace")[-3000:]
        errors = [line for line in tail.splitlines() if "Error" in line]
        why = " (SIGKILL: on Linux most often the out-of-memory killer)" if code == -signal.SIGKILL else ""
        raise EngineError(f"engine {self.name!r}: the process exited ({code}){why}"
                          + (f": {errors[-1]}" if errors else "") + f"; its log ({self.log}) ends:\n{tail}")

    def send(self, line: str) -> None:
        """Write one line to the process's stdin (a process already gone: :meth:`read` reports how it ended)."""
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass

    def request(self, job: dict[str, Any]) -> dict[str, Any]:
        """One JSON request line, one ``REPLY {json}`` line back; a reply with ``error`` raises
        :class:`EngineError` (the protocol of :mod:`.worker`)."""
        self.send(json.dumps(job))
        reply = json.loads(self.read("REPLY "))
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    """Whether the server on ``127.0.0.1:port`` answers ``/health`` with 200."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


@contextmanager
def openai_server(launch: EngineLaunch, model: str | Path, log: Path, *, dtype: str, max_model_len: int,
                  max_num_seqs: int, served_name: str = "served", start_timeout_s: float = 600,
                  python: str | None = None) -> Iterator[tuple[int, subprocess.Popen]]:
    """vLLM's OpenAI-compatible server for ``model`` (a checkpoint folder) on 127.0.0.1 at a free
    port, in ``launch``'s mode (:meth:`EngineLaunch.env` with ``server=True``; ``--speculative-config``
    for a ``<selector>@K`` mode), eager, one worker
    (``uni``), its requests' model named ``served_name``, its output in ``log``; ready (``/health``)
    within ``start_timeout_s`` (else a ``RuntimeError`` with the end of the log). Yields ``(port,
    process)`` and stops the server's process group after."""
    port = _free_port()
    cmd = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
           "--enforce-eager", "--max-num-seqs", str(max_num_seqs), "--distributed-executor-backend", "uni",
           "--served-model-name", served_name, "--disable-uvicorn-access-log"]
    if (spec := launch.speculative_config()) is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=launch.env(server=True), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + start_timeout_s
        while not healthy(port):
            if proc.poll() is not None:
                raise RuntimeError("server exited at start-up:\n" + log.read_text()[-5000:])
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready in {start_timeout_s} s:\n" + log.read_text()[-5000:])
            time.sleep(2)
        yield port, proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
