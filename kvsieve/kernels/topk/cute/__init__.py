"""CuTe-DSL GVR top-k (Guess-Verify-Refine, self-sampling) for SM90/SM100/SM103: one CTA per row,
shared-memory histogram and candidate scratch, exact with the Triton kernels' tie rule.

``host.gvr_topk(scores, lengths, k, out)`` is what ``kvsieve.kernels.topk.plan`` calls for the
``cute_gvr`` engine (its result: ``naive.radix_topk``'s); ``device`` (the kernel), ``params`` (its
launch constants), ``compile`` (kernel object and compile arguments), ``mirror`` (a PyTorch
transcription of the algorithm for CPU tests). Importing ``host`` needs neither a GPU nor
``cutlass``.
"""
