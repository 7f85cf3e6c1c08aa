"""Timing helpers: warm-up, then repeated runs; report the median with the spread (min, max, IQR).

Every figure also carries the 1-minute load average at the time it was taken (``os.getloadavg``),
because the benchmark machines are shared and a busy neighbour moves the numbers.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = ["Timing", "measure", "load_average", "load_averages", "fmt_ms", "cpu_isa", "write_stamped_json"]


@dataclass(frozen=True)
class Timing:
    """Seconds per call over ``reps`` timed runs (after ``warmup`` untimed ones)."""

    median_s: float
    min_s: float
    max_s: float
    q1_s: float
    q3_s: float
    reps: int
    warmup: int
    load_1m: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)

    @property
    def spread(self) -> str:
        """``[min, max]`` in ms, for tables."""
        return f"[{self.min_s * 1e3:.3g}, {self.max_s * 1e3:.3g}]"


def load_averages() -> list[float]:
    """The 1-, 5- and 15-minute load averages (``os.getloadavg``), rounded to 0.01."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on Linux/macOS
        return [float("nan")] * 3


# the CPU features that decide kernel speed here, widest first (bf16 is emulated without avx512_bf16/amx_bf16)
_ISA_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512f", "avx2", "fma", "neon", "asimd", "sve")


def cpu_isa() -> str:
    """The CPU model and the instruction-set features of :data:`_ISA_FLAGS` it has, e.g.
    ``"Intel(R) Xeon(R) Processor: amx_bf16 amx_tile avx512_bf16 avx512_fp16 avx512f avx2 fma"``
    (printed beside every timing: figures are not comparable across CPUs)."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:  # pragma: no cover - not Linux
        pass
    return f"{model}: " + " ".join(f for f in _ISA_FLAGS if f in flags)


def load_average() -> float:
    """The 1-minute load average."""
    return load_averages()[0]


def measure(fn: Callable[[], object], *, warmup: int = 1, min_reps: int = 3, max_reps: int = 50,
            budget_s: float = 0.5, setup: Callable[[], object] | None = None) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then at least ``min_reps`` timed calls and more while
    the total stays under ``budget_s`` (at most ``max_reps``). ``setup`` (untimed) runs before each call."""
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    times: list[float] = []
    spent = 0.0
    while len(times) < min_reps or (spent < budget_s and len(times) < max_reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
    times.sort()
    if len(times) >= 4:
        q = statistics.quantiles(times, n=4)
        q1, q3 = q[0], q[2]
    else:
        q1, q3 = times[0], times[-1]
    return Timing(median_s=statistics.median(times), min_s=times[0], max_s=times[-1], q1_s=q1, q3_s=q3,
                  reps=len(times), warmup=warmup, load_1m=load_average())


def fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 1:
        return f"{ms:.2f}"
    return f"{ms:.3f}"


def write_stamped_json(out: str | Path, name: str, payload: dict[str, Any]) -> Path:
    """``payload`` as ``<out>/<name>-<UTC time>.json`` (the folder made when missing); prints and returns
    the path."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(payload, indent=1))
    print(f"written: {path}")
    return path
