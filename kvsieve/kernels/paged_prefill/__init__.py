"""Paged prefill / chunked prefill over a paged GQA cache: dense query tiles, or per-token sparse
gather (the shared gather attention, as the GQA decode; validated by
``kvsieve.kernels.common.gather.plan.plan_gqa_gather``).

``plan`` (path selection, query tiling, the dense path's launch plan), ``triton`` (the kernels),
``naive`` (their plain-PyTorch reference).
"""
