#!/usr/bin/env bash
# Verify every kvsieve kernel on a GPU machine from a bare checkout, nothing installed beyond its
# image (python3 with torch, triton, pytest; nvcc, compute-sanitizer). Runs from the source tree
# (no pip install: kvsieve's pins need not match the image). Writes gpu_check.json/.md into $OUT
# (or ./gpu_check_out) and exits non-zero on any mismatch. Pass --dry-run on a machine without a GPU.
# The CuTe-DSL kernels are checked from .cute_aot/sm90 when it was built and carried
# (python -m kvsieve.kernels.aot.cute_bundle build --out .cute_aot/sm90; docs/kernels.md, "GPU verification").
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" -m kvsieve.gpu_check --out "${OUT:-gpu_check_out}" "$@"
