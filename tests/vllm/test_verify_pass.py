"""The verify pass of lossless decoding in vLLM (:func:`kvsieve.integrations.vllm.host.verify_pass`),
without vLLM: a dense step under kvsieve's drafter whose requests have few query tokens each takes
kvsieve's causal-rows kernel over the vLLM-CPU-layout cache, and equals the Vanilla golden on the
same step; a step with a prompt chunk keeps the host's own attention, and so does a step
that is not dense (no drafter)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsieve.integrations.vllm.config import PluginConfig, parse_selector_spec
from kvsieve.integrations.vllm.host import VERIFY_MAX_TOKENS
from kvsieve.integrations.vllm.layer import LayerRunner
from kvsieve.integrations.vllm.layouts import kv_views
from kvsieve.integrations.vllm.startup import lower_plans
from kvsieve.integrations.vllm.step import StepTranslator, VllmStep
from kvsieve.kernels.causal_rows.native import SOURCE as CAUSAL_SOURCE
from kvsieve.kernels.common.native import native_status
from kvsieve.metadata.foreign_paged import ForeignKVSpec, ForeignPagedKV
from kvsieve.sparse import AttentionGeometry, get_backend
from kvsieve.sparse.backends import VanillaBackend

HKV, G, D, P, BLOCKS, W = 2, 3, 32, 16, 64, 12
# query tokens per request (requests 0, 1, 2): prompts (one over the verify bound), then verify
# passes of K + 1 = 3 and 5 rows beside requests that drafted nothing (one row), then a prompt chunk
STEPS = [(150, 40, 30), (3, 3, 1), (5, 1, 3), (3, 3, 3), (1, 1, VERIFY_MAX_TOKENS + 1)]


class _Host:
    """The host's own dense attention, counted: the Vanilla golden on the prepared step, in vLLM's order."""

    def __init__(self, prepared, layer_idx, q, geometry):  # noqa: ANN001
        self.prepared, self.layer_idx, self.q, self.geometry, self.calls = prepared, layer_idx, q, geometry, 0

    def dense(self) -> torch.Tensor:
        self.calls += 1
        out = VanillaBackend().forward(self.prepared.to_kvsieve(self.q), self.prepared.metadata, self.layer_idx,
                                       self.geometry, None).out
        got = torch.empty_like(out)
        self.prepared.to_vllm(out, got)
        return got


@pytest.mark.skipif(native_status(CAUSAL_SOURCE) != "native", reason="the causal-rows kernel's library is not there")
@pytest.mark.parametrize("selector,dense", [(None, True), ("quest:budget=32,page_size=16", True), (None, False)],
                         ids=["dense_layer", "quest_layer", "dense_layer_no_drafter"])
def test_a_verify_pass_reads_causal_runs_and_equals_the_golden(selector, dense):
    """(Without the drafter a selecting layer's decode rows select: tests/vllm/test_view.py.)"""
    gen = torch.Generator().manual_seed(0)
    view = ForeignPagedKV(ForeignKVSpec(num_layers=1, num_blocks=BLOCKS, tokens_per_block=P, num_kv_heads=HKV,
                                        head_dim=D, dtype=torch.float32, device=torch.device("cpu"),
                                        layout="vllm-cpu", max_requests=4, max_blocks_per_seq=W))
    raw = torch.full((BLOCKS, HKV, P, 2 * D), float("nan"))
    view.bind_layer(0, raw, *kv_views("vllm-cpu", raw))
    cfg = None if selector is None else parse_selector_spec(selector)
    plan = lower_plans(PluginConfig(sparse=cfg), num_layers=1, backend_name="torch")[0]
    geometry = AttentionGeometry(kind="gqa", num_q_heads=HKV * G, num_kv_heads=HKV, head_dim=D, sm_scale=D ** -0.5)
    runner = LayerRunner(layer_idx=0, geometry=geometry, plan=plan, backend=get_backend("torch"))
    translator = StepTranslator(view, max_num_tokens=512, translations=("block_lists",))
    table = np.arange(3 * W, dtype=np.int32).reshape(3, W)[:, ::-1].copy()  # blocks out of order
    held = np.zeros(3, dtype=np.int64)
    for lens in STEPS:
        lens = np.array(lens)
        kv_lens = (held + lens).astype(np.int32)
        pos = np.concatenate([np.arange(h, h + n) for h, n in zip(held, lens)])
        req = np.repeat(np.arange(3), lens)
        t = int(lens.sum())
        q, k, v = torch.randn(t, HKV * G, D, generator=gen), torch.randn(t, HKV, D, generator=gen), \
            torch.randn(t, HKV, D, generator=gen)
        view.k_cache(0)[table[req, pos // P], :, pos % P] = k  # vLLM writes the step's K/V first
        view.v_cache(0)[table[req, pos // P], :, pos % P] = v
        step = VllmStep(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32), kv_lens, table.copy(),
                        prompt_lens=kv_lens if dense else np.where(lens == 1, kv_lens - 1, kv_lens).astype(np.int32),
                        dense=dense)
        prepared = translator.prepare(step)
        host = _Host(prepared, 0, q, geometry)
        res = runner.forward(prepared.to_kvsieve(q), prepared.to_kvsieve(k), prepared.to_kvsieve(v), prepared, host)
        got = torch.empty_like(res.out)
        prepared.to_vllm(res.out, got)
        held += lens
        verify = dense and lens.max() <= VERIFY_MAX_TOKENS
        assert set(res.paths.values()) == ({"causal_rows"} if verify else {"host_dense"}), (lens, res.paths)
        assert host.calls == (0 if verify else 1)
        ref = VanillaBackend().forward(prepared.to_kvsieve(q), prepared.metadata, 0, geometry, None).out
        expected = torch.empty_like(ref)
        prepared.to_vllm(ref, expected)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
