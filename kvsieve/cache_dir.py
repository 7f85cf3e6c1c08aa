"""Where kvsieve keeps what it builds or converts once per machine (converted checkpoints, native
CPU kernels)."""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_cache_dir"]


def default_cache_dir() -> Path:
    """``$KVSIEVE_CACHE`` or ``$XDG_CACHE_HOME/kvsieve`` (``~/.cache/kvsieve``)."""
    env = os.environ.get("KVSIEVE_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvsieve"
