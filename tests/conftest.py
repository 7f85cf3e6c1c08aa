"""Suite-wide setup. Without a CUDA device, Triton kernels run under the Triton interpreter; the
variable must be set before any kernel module is imported (``triton.jit`` reads it then)."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
