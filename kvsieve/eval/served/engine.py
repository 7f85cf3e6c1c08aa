"""The vLLM engine processes of ``kvsieve eval --engine vllm``, seen from the sweep.

Each engine is one process of vLLM's environment running :mod:`.worker` (the plug-in's selector is
fixed per process): vLLM's own attention (plug-in off) or the plug-in with one selector entry's
config file, the budget of each request set per request. The process is started by the launcher
every vLLM engine of kvsieve uses (:mod:`.launch`: its environment, its model folder, which Python
runs it).
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from ...sparse import SparseAttentionConfig
from .launch import EngineLaunch, EngineProcess

__all__ = ["plugin_config_file", "start_engine"]

_WORKER = ["-m", "kvsieve.eval.served.worker"]


def plugin_config_file(path: Path, sparse: SparseAttentionConfig, backend: str) -> Path:
    """Write the plug-in's ``KVSIEVE_CONFIG`` file for ``sparse`` (selector, params, dense layers,
    phases, backend) to ``path``, declaring ``prompt_settings``: the sweep gives every setting of a
    selector that selects in the prompt its own ``cache_salt`` (:func:`.protocol.cache_salt`)."""
    raw = {"selector": sparse.selector, "params": dict(sparse.params), "dense_layers": list(sparse.dense_layers),
           "phases": list(sparse.phases) if sparse.phases else None, "backend": backend, "prompt_settings": True}
    path.write_text(yaml.safe_dump({k: v for k, v in raw.items() if v is not None}, sort_keys=False), encoding="utf-8")
    return path


def start_engine(name: str, python: str, model_dir: Path, launch: EngineLaunch, *, dtype: str, max_model_len: int,
                 max_num_seqs: int, log: Path) -> EngineProcess:
    """One :mod:`.worker` process for ``model_dir`` in ``launch``'s mode (a lossless ``<config>@K`` mode:
    with vLLM's speculative decoding), ready; ``log``: its stderr."""
    cmd = [python, *_WORKER, "--model", str(model_dir), "--dtype", dtype, "--max-model-len", str(max_model_len),
           "--max-num-seqs", str(max_num_seqs)]
    if (spec := launch.speculative_config()) is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    return EngineProcess(name, cmd, launch.env(), log)
