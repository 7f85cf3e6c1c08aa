"""The process's resident memory (Linux ``/proc``): its high-water mark since the last reset, and
now. Elsewhere both are ``None`` (the eval and the benchmarks then report no memory)."""
from __future__ import annotations

from pathlib import Path

__all__ = ["reset_peak_rss", "rss_mb"]


def reset_peak_rss() -> None:
    """Reset the kernel's resident high-water mark (``VmHWM``) of this process; a no-op without ``/proc``."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def rss_mb() -> tuple[float | None, float | None]:
    """(peak resident MiB since the last :func:`reset_peak_rss`, current resident MiB)."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None, None
    status = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return int(status["VmHWM"].split()[0]) / 1024, int(status["VmRSS"].split()[0]) / 1024
