"""One prepared command that verifies every kvsieve kernel on a GPU machine within minutes.

``tools/gpu_check.sh`` (or ``python -m kvsieve.gpu_check``) runs, each step in a child process
under its own time budget: the environment probe, the import check, the Triton kernels against
their references on awkward shapes (``cases``), the GPU tests (``pytest -m "sm90 or sm100"``),
the kernel benchmarks (GB/s against HBM peak, TFLOP/s against the measured bf16 matmul rate),
``compute-sanitizer`` on one small case of each kernel, and the CuTe-DSL kernels from their
ahead-of-time bundle (``kvsieve.kernels.aot.cute_bundle``). It writes ``gpu_check.json`` and
``gpu_check.md`` and exits non-zero on any mismatch. ``--dry-run`` runs the same driver on a
machine without a GPU: the CPU parts run for real (the cases under the Triton interpreter in
fp32, the bundle's files and loader), the GPU parts are reported as skipped. See
docs/kernels.md, "GPU verification".
"""
