"""Native CPU kernels: C compiled on first use for this machine (:mod:`.build`), each beside a
plain-PyTorch ``naive`` twin that computes the same thing and runs where the native one cannot."""
from __future__ import annotations

from .build import ENV_VAR, NativeUnavailable, native_status
from .head_tables import SOURCE as _HEAD_TABLES
from .page_minmax import SOURCE as _PAGE_MINMAX
from .page_topk import SOURCE as _PAGE_TOPK
from .page_topk import PageTopK, page_topk
from .segment_check import SOURCE as _SEGMENT_CHECK
from .sparse_decode.native import SOURCE as _SPARSE_DECODE

__all__ = ["ENV_VAR", "NativeUnavailable", "PageTopK", "native_kernels_status", "native_status", "page_topk"]


def native_kernels_status() -> dict[str, str]:
    """Per native kernel, what this process runs: ``"native"`` or ``"torch (<why>)"``."""
    return {"page_topk": native_status(_PAGE_TOPK), "sparse_decode": native_status(_SPARSE_DECODE),
            "segment_check": native_status(_SEGMENT_CHECK), "head_tables": native_status(_HEAD_TABLES),
            "page_minmax": native_status(_PAGE_MINMAX)}
