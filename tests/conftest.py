"""Suite-wide setup: Triton kernels in this process run under the Triton interpreter, on CPU
tensors, whatever folder is collected first. The variable must be set before any kernel module is
imported (``triton.jit`` reads it then). Device tests of the Triton kernels (``sm90``/``sm100``)
run their checks in a subprocess without it (tests/kernels/test_gpu.py); the CuTe-DSL kernels do
not read it."""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
# the report scripts under tools/ (recall_table, snapkv_variants) are imported by tests of several folders
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
