"""CuTe-DSL basics every CuTe kernel's host code shares: whether the DSL imports, which of the
supported architectures a device is, the ``--gpu-arch`` flag of each and the shared-memory limit."""
from __future__ import annotations

SMEM_LIMIT = 227 * 1024
ARCH_FLAGS = {"sm90": "sm_90a", "sm100": "sm_100a"}

__all__ = ["ARCH_FLAGS", "SMEM_LIMIT", "cute_available", "detect_arch"]


def cute_available() -> tuple[bool, str]:
    """``(True, "")`` when ``nvidia-cutlass-dsl`` imports, else ``(False, reason)``."""
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the environment
        return False, f"nvidia-cutlass-dsl is not importable ({type(e).__name__}: {e})"
    return True, ""


def detect_arch(device: object) -> str | None:
    """``"sm90"`` / ``"sm100"`` for a CUDA device of compute capability 9.x / 10.x, else None."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    major, _ = torch.cuda.get_device_capability(dev)
    return {9: "sm90", 10: "sm100"}.get(major)
