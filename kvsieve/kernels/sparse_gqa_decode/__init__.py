"""Sparse (or dense) paged GQA decode: attention of each query token over its selected KV positions.

``triton`` (the portable kernel on the shared gather attention, split-K and skip-softmax; validated
and planned by ``kvsieve.kernels.common.gather.plan.plan_gqa_gather``), ``cute`` (SM90/SM100
CuTe-DSL, sparse, block granularity), ``native`` + ``sparse_gqa_decode.c`` + ``runs`` (the CPU
kernels over runs of the cache, for decode tokens on the host), ``naive`` (the plain-PyTorch
references of all of them).
"""
