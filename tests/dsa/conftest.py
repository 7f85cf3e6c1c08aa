"""DSA tests run the Triton kernels under the interpreter on CPU: TRITON_INTERPRET must be set
before ``triton.jit`` decorates them (first import of a kernel module), so it is set here.
AOT compilation runs in a subprocess with it unset (``test_aot.py``)."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
