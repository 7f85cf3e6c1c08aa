"""benchmarks/vllm_cpu.py without vLLM: the memory check that refuses a run whose engines (one per
mode, all up at once) would not fit, before any starts."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.vllm_cpu import _kv_space_gib, check_memory


def _args(dtype: str, concurrency: list[int]) -> SimpleNamespace:
    return SimpleNamespace(model_name="smollm2", dtype=dtype, prompt_tokens=8000, max_tokens=16,
                           concurrency=concurrency, block_size=128)


def test_three_fp32_engines_at_eight_requests_do_not_fit_in_24_gib():
    """SmolLM2 fp32 at 8 requests of 8K: 6 GiB of KV space an engine; three modes need about 24 GiB and
    are refused on a 23 GiB machine (the out-of-memory killer ended such a run), two fit, as do three
    in bf16 or at one request."""
    kv = _kv_space_gib(_args("float32", [1, 8]))
    assert kv == 6
    with pytest.raises(SystemExit, match=r"3 engines .* need about 24 GiB .*23\.0 GiB are available"):
        check_memory(3, kv, 23.0)
    check_memory(2, kv, 23.0)
    check_memory(3, _kv_space_gib(_args("bfloat16", [1, 8])), 23.0)
    check_memory(3, _kv_space_gib(_args("float32", [1])), 23.0)
