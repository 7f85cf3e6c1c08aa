"""Sparse absorbed-MLA decode over a paged latent cache (head groups per program, split-K).

``plan`` (validation and launch plan), ``triton`` (the portable kernel, on the shared gather
attention), ``cute`` (SM90/SM100 CuTe-DSL, bf16 or FP8 latent rows), ``fp8`` (the FlashMLA FP8
row format), ``naive`` (the plain-PyTorch references).
"""
