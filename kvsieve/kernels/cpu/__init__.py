"""Native CPU kernels: C compiled on first use for this machine (:mod:`.build`), each beside a
plain-PyTorch ``naive`` twin that computes the same thing and runs where the native one cannot."""
from __future__ import annotations

from .build import ENV_VAR, NativeUnavailable, native_status
from .page_topk import PageTopK, page_topk, page_topk_status

__all__ = ["ENV_VAR", "NativeUnavailable", "PageTopK", "native_status", "page_topk", "page_topk_status"]
