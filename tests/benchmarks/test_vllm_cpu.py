"""benchmarks/vllm_cpu.py without vLLM: the memory check that refuses a run whose engines (one per
mode, all up at once) would not fit, before any starts; the attention layers' timer and the table's
bound (``--layer-times``) on stand-in modules and rows."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks.vllm_cpu import (AttentionTimer, _kv_space_gib, _table, check_memory, free_full_attention_bound,
                                 prompt_ids, same_rest_ratio)


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


class _Attention(torch.nn.Module):
    """A stand-in for vLLM's ``Attention`` module: ``impl.sliding_window`` as CPU_ATTN's impl keeps it;
    each call advances the test's clock by ``cost`` seconds."""

    def __init__(self, window: int, cost: float, clock: list[float]) -> None:
        super().__init__()
        self.impl = SimpleNamespace(sliding_window=window)
        self.cost, self.clock = cost, clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock[0] += self.cost
        return x


def test_attention_timer_times_each_layer_call_and_splits_the_full_attention_layers():
    now = [0.0]
    layers = {i: _Attention(-1, 0.004, now) if i % 3 == 2 else _Attention(512, 0.001, now) for i in range(6)}
    layers[5].impl.sliding_window = None  # vLLM's other spelling of no window
    timer = AttentionTimer(layers, clock=lambda: now[0])
    assert timer.full == {2, 5}
    x = torch.zeros(1)
    steps = []
    for _ in range(3):
        now[0] += 1.0  # the rest of the step: not an attention call
        for module in layers.values():
            module(x)
        layers[2](x)  # a layer called twice in a step adds up
        steps.append(timer.take())
    assert timer.take() == {}
    assert all(t == pytest.approx({0: 0.001, 1: 0.001, 2: 0.008, 3: 0.001, 4: 0.001, 5: 0.004}) for t in steps)
    assert timer.summary(steps) == pytest.approx({"attn_ms": 16.0, "full_attn_ms": 12.0})


def test_attention_timer_refuses_an_engine_without_attention_layers():
    with pytest.raises(ValueError, match="no attention layers to time"):
        AttentionTimer({})


def test_table_bound_is_the_first_modes_step_without_its_full_attention_layers():
    """A first mode of 100 ms steps with 10 ms in full-attention layers: a mode whose full-attention layers
    cost nothing would decode 100 / 90 = 1.111x as fast; the bound is reported for the first mode only.
    A second mode whose steps are 95 ms with 6 ms of attention (the first's: 12) has an attention ratio
    of 100 / 94: its rest of the step (89 ms) is 1 ms longer than the first's (88)."""
    rows = [{"rep": rep, "mode": mode, "concurrency": 1, "cold_prompts": 0, "prefill_s": 1.0,
             "decode_step_ms": step, "decode_tok_s": 1e3 / step, "attn_ms": attn, "full_attn_ms": full}
            for rep in range(2) for mode, step, attn, full in (("own", 100.0, 12.0, 10.0), ("dsa", 95.0, 6.0, 4.0))]
    table = _table(rows, ["own", "dsa"], [1])
    own, dsa = table
    assert free_full_attention_bound(rows[0]) == 100 / 90 and same_rest_ratio(rows[0], rows[1]) == 100 / 94
    assert own["bound"] == round(100 / 90, 3) and dsa["bound"] is None
    assert dsa["decode_ratio"] == round(100 / 95, 3) and dsa["full_attn_ms"] == 4.0 and own["attn_ms"] == 12.0
    # the attention ratio takes the rest of the step as the first mode's: 100 / (100 - 12 + 6), not 100 / 95
    assert dsa["attn_ratio"] == round(100 / 94, 3) and own["attn_ratio"] == 1.0


class _WordTokenizer:
    """A stand-in tokenizer: one id per whitespace-separated word (a BOS id 1 unless told otherwise)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [hash(w) % 50000 + 2 for w in text.split()]


@pytest.mark.parametrize("shared", [False, True])
def test_prompts_share_a_document_only_when_asked(shared):
    """``--shared-prefix``: every prompt the same length and the same up to its own last line (so all
    of their blocks but the last are one); without it no two prompts share their first block."""
    prompts = prompt_ids(_WordTokenizer(), 8, 300, shared_prefix=shared)
    assert {len(p) for p in prompts} == {300} and len({tuple(p) for p in prompts}) == 8
    common = min(next((j for j, (a, b) in enumerate(zip(p, prompts[0])) if a != b), 300) for p in prompts[1:])
    if shared:
        assert common >= 300 - 3  # " Letter i." is two words here
    else:
        assert common < 128


def test_prompts_too_short_for_their_own_line_are_refused():
    """A shared-prefix prompt shorter than a request's own line would come out longer than asked:
    refused, naming --prompt-tokens."""
    with pytest.raises(ValueError, match=r"--prompt-tokens 1: the prompts came out \[2\] tokens long"):
        prompt_ids(_WordTokenizer(), 3, 1, shared_prefix=True)
