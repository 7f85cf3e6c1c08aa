"""Merge partial attention states (split-K second pass), shared by the gather attention's Triton
kernel, its reference and the CuTe host: ``triton`` (the kernel), ``naive`` (its reference)."""
