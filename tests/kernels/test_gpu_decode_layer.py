"""The decode layer's device path captured in a CUDA graph (skipped without the GPU): one decode step
of Quest and of the DSA indexer is captured on static tensors, the next steps change only their
values (lengths, queries, a row turned into padding) and replay; every replay equals the eager path
on a copy of the state (pools included), so nothing in the path synchronises with the host or takes
a shape from a value."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvsieve.kernels.decode_layer.device import decode_layer_device
from kvsieve.kernels.decode_layer.plan import DecodeProgram, IndexerStep


def _cap() -> int:
    return torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else -1


def _programs(dev: torch.device, blocks: int, hkv: int, bs: int, d: int) -> list[DecodeProgram]:
    gen = torch.Generator(device=dev).manual_seed(0)
    pool = torch.randn(blocks, hkv, bs // 16, 2, d, device=dev, generator=gen).to(torch.bfloat16)
    pool = torch.stack([pool[:, :, :, 0].minimum(pool[:, :, :, 1]), pool[:, :, :, 0].maximum(pool[:, :, :, 1])], 3)
    keys = torch.randn(blocks, bs, 64, device=dev, generator=gen).to(torch.bfloat16)
    return [DecodeProgram("pages", units=8, unit=16, mode="bound", pool=pool, page_size=16),
            DecodeProgram("indexer", units=256, index_keys=keys)]


def _check_graph() -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    b, w, bs, hkv, g, d, blocks = 4, 64, 16, 8, 4, 128, 4 * 64 + 1
    gen = torch.Generator(device=dev).manual_seed(1)
    k = torch.randn(blocks, bs, hkv, d, device=dev, generator=gen).to(dt).transpose(1, 2)  # NHD, as TRITON_ATTN
    v = torch.randn(blocks, bs, hkv, d, device=dev, generator=gen).to(dt).transpose(1, 2)
    table = (torch.arange(b * w, device=dev, dtype=torch.int32) + 1).view(b, w)
    for program in _programs(dev, blocks, hkv, bs, d):
        lens = torch.tensor([900, 37, 1000, 512], device=dev, dtype=torch.int32)
        q = torch.randn(b, hkv * g, d, device=dev, generator=gen).to(dt)
        index = IndexerStep(torch.randn(b, 8, 64, device=dev, generator=gen), torch.randn(b, 8, device=dev, generator=gen),
                            torch.randn(b, 64, device=dev, generator=gen)) if program.kind == "indexer" else None
        out = torch.empty_like(q)
        step = dict(sm_scale=d ** -0.5, index=index)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture, as torch's docs ask
            decode_layer_device(k, v, program, table, lens, q, out, **step)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            attended = decode_layer_device(k, v, program, table, lens, q, out, **step)
        for new_lens in ([901, 38, 1001, 0], [902, 39, 1002, 1]):  # next steps; a row becomes padding, then short
            lens.copy_(torch.tensor(new_lens, device=dev))
            q.copy_(torch.randn(b, hkv * g, d, device=dev, generator=gen).to(dt))
            if index is not None:
                for t in (index.q, index.weights, index.keys):
                    t.copy_(torch.randn(t.shape, device=dev, generator=gen))
            twin = replace(program, pool=None if program.pool is None else program.pool.clone(),
                           index_keys=None if program.index_keys is None else program.index_keys.clone())
            want = torch.empty_like(out)
            want_attended = decode_layer_device(k, v, twin, table, lens, q, want, **step)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(attended, want_attended), program.kind
            torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
            for mine, ref in ((program.pool, twin.pool), (program.index_keys, twin.index_keys)):
                if mine is not None:
                    assert torch.equal(mine, ref)
            assert int(attended[lens == 0].sum()) == 0
            assert bool((attended[lens > 0] < lens[lens > 0, None].long()).any())  # it skips


@pytest.mark.sm90
@pytest.mark.skipif(_cap() != 9, reason="needs an SM90 GPU")
def test_sm90_decode_layer_in_a_cuda_graph():
    _check_graph()


@pytest.mark.sm100
@pytest.mark.skipif(_cap() != 10, reason="needs an SM100 GPU")
def test_sm100_decode_layer_in_a_cuda_graph():
    _check_graph()
