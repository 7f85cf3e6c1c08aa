"""``kvsieve_decode_layer`` (one layer's decode step in one native call) against its plain-PyTorch
twin: every program, vLLM's CPU layout (K by channel) and kvsieve's (K by rows), bf16 and fp32,
rows shorter and longer than the budget, scattered blocks. The positions each (row, KV head) reads
are equal, the outputs equal to fp32 rounding, the pools written equal bit for bit."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from kvsieve.kernels.common.native import native_status
from kvsieve.kernels.decode_layer.naive import decode_layer_naive
from kvsieve.kernels.decode_layer.native import SOURCE, DecodeLayerCall
from kvsieve.kernels.decode_layer.plan import DecodeProgram, IndexerStep

pytestmark = pytest.mark.skipif(native_status(SOURCE) != "native", reason="no C compiler for the native kernel")

HKV, G, D, BS, BLOCKS = 2, 3, 32, 32, 40
LENS = (200, 97, 20, 33)
PROGRAMS = {
    "pages-bound": dict(kind="pages", units=4, unit=16, mode="bound", page_size=16),
    "pages-sign": dict(kind="pages", units=3, unit=8, mode="sign", page_size=8),
    "pages-whole-blocks": dict(kind="pages", units=2, unit=32, mode="bound", page_size=32),
    "streaming": dict(kind="streaming", units=40, num_sink=4),
    "streaming-no-sink": dict(kind="streaming", units=24),
    "tokens": dict(kind="tokens_exact", units=30),
    "tokens-units": dict(kind="tokens_exact", units=5, unit=8),
    "blocks-max": dict(kind="blocks_exact", units=3, unit=32, mode="max", local_units=1),
    "blocks-mean": dict(kind="blocks_exact", units=4, unit=16, mode="mean", init_units=1, local_units=1),
    "blocks-64": dict(kind="blocks_exact", units=2, unit=64, mode="max", local_units=1),
    "blocks-bound": dict(kind="blocks_bound", units=3, unit=32, page_size=16, local_units=1),
    "indexer": dict(kind="indexer", units=24),
}


def _cache(layout: str, dtype: torch.dtype, gen: torch.Generator, blocks: int = BLOCKS
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V views ``[blocks, HKV, BS, D]``: vLLM's CPU tile (K by channel) or two row-major pools."""
    if layout == "vllm-cpu":
        raw = torch.randn(blocks, HKV, BS, 2 * D, generator=gen).to(dtype)
        half = raw.view(blocks, HKV, 2 * BS, D)
        k = half[:, :, :BS].reshape(blocks, HKV, D, BS).transpose(2, 3)  # stored by channel
        return k, half[:, :, BS:]
    return (torch.randn(blocks, HKV, BS, D, generator=gen).to(dtype) for _ in range(2))


def _with_pools(spec: dict, k: torch.Tensor, table: np.ndarray, dtype: torch.dtype, gen: torch.Generator,
                lens: tuple[int, ...]) -> DecodeProgram:
    """The program with its pools as earlier steps left them: every page of the rows (``lens``)
    summarized over the positions before each row's new token; index keys random (the row's own
    written by the call)."""
    pool = index_keys = None
    blocks = k.shape[0]
    if "page_size" in spec:
        ps = spec["page_size"]
        pool = torch.full((blocks, HKV, BS // ps, 2, D), float("nan"), dtype=dtype)
        for r, length in enumerate(lens):
            for first in range(0, length - 1, ps):
                blk = int(table[r, first // BS])
                keys = k[blk, :, first % BS: first % BS + min(ps, length - 1 - first)].float()  # [Hkv, n, D]
                pool[blk, :, (first % BS) // ps, 0] = keys.amin(1).to(dtype)
                pool[blk, :, (first % BS) // ps, 1] = keys.amax(1).to(dtype)
    if spec["kind"] == "indexer":
        index_keys = torch.randn(blocks, BS, 16, generator=gen).to(dtype)
    return DecodeProgram(**spec, pool=pool, index_keys=index_keys)


def _case(name: str, layout: str, dtype: torch.dtype, seed: int, rows: int, lens: tuple[int, ...] = LENS
          ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray, DecodeProgram, torch.Tensor, IndexerStep | None]:
    """``(k, v, table, lens, program, q, index)``: a cache, the rows of ``lens`` over shuffled blocks
    (:data:`BLOCKS` of them for :data:`LENS`), the program with its pools, ``rows`` query rows and,
    for the indexer, its step inputs (positive weights: scores tie only at 0, below the top-k
    boundary)."""
    gen = torch.Generator().manual_seed(seed)
    per = -(-max(lens) // BS)
    blocks = BLOCKS if lens == LENS else per * len(lens) + 1
    k, v = _cache(layout, dtype, gen, blocks)
    table = (torch.randperm(blocks - 1, generator=gen)[: per * len(lens)].numpy().astype(np.int32) + 1)
    table = table.reshape(len(lens), per)
    program = _with_pools(PROGRAMS[name], k, table, dtype, gen, lens)
    q = torch.randn(rows, HKV * G, D, generator=gen).to(dtype)
    index = None
    if program.kind == "indexer":
        index = IndexerStep(torch.randn(rows, 4, 16, generator=gen).to(dtype).float(),
                            torch.rand(rows, 4, generator=gen) + 0.1, torch.randn(rows, 16, generator=gen))
    return k, v, table, np.array(lens, dtype=np.int32), program, q, index


def _twin(program: DecodeProgram) -> DecodeProgram:
    """The program over copies of its pools."""
    return replace(program, pool=None if program.pool is None else program.pool.clone(),
                   index_keys=None if program.index_keys is None else program.index_keys.clone())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["vllm-cpu", "rows"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_native_equals_naive(name, layout, dtype):
    k, v, table, lens, program, q, index = _case(name, layout, dtype, 0, len(LENS))
    twin = _twin(program)
    out = torch.empty(len(LENS), HKV * G, D, dtype=torch.float32)
    attended = DecodeLayerCall(k, v, program, num_q_heads=HKV * G, sm_scale=D ** -0.5).run(table, lens, q, out, index)
    want, want_attended = decode_layer_naive(k, v, twin, table, lens, q, sm_scale=D ** -0.5, index=index)
    np.testing.assert_array_equal(attended, want_attended)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    for got, ref in ((program.pool, twin.pool), (program.index_keys, twin.index_keys)):
        if got is not None:
            assert torch.equal(got.float().nan_to_num(7.0), ref.float().nan_to_num(7.0))
    assert (attended < lens[:, None]).any()  # something skipped


def test_bf16_output_and_strided_rows():
    """q and out may be rows of a wider buffer (vLLM's padded query / output) and bf16: the kernel writes
    each row where it lies and rounds to nearest-even, as torch's conversion does."""
    gen = torch.Generator().manual_seed(1)
    k, v = _cache("vllm-cpu", torch.bfloat16, gen)
    table = np.arange(1, 1 + 2 * 4, dtype=np.int32).reshape(2, 4)
    lens = np.array([100, 64], dtype=np.int32)
    program = DecodeProgram("streaming", units=32, num_sink=4)
    buf_q = torch.randn(3, HKV * G, D, generator=gen).to(torch.bfloat16)
    buf_out = torch.zeros(3, HKV * G, D, dtype=torch.bfloat16)
    call = DecodeLayerCall(k, v, program, num_q_heads=HKV * G, sm_scale=D ** -0.5)
    call.run(table, lens, buf_q[:2], buf_out[:2])
    want, _ = decode_layer_naive(k, v, program, table, lens, buf_q[:2], sm_scale=D ** -0.5)
    torch.testing.assert_close(buf_out[:2].float(), want.to(torch.bfloat16).float(), rtol=0, atol=2 ** -7)
    assert not buf_out[2].any()  # the padding row untouched


def test_refused_inputs_name_the_problem():
    gen = torch.Generator().manual_seed(2)
    k, v = _cache("vllm-cpu", torch.float32, gen)
    call = DecodeLayerCall(k, v, DecodeProgram("streaming", units=8), num_q_heads=HKV * G, sm_scale=1.0)
    q = torch.randn(1, HKV * G, D, generator=gen)
    out = torch.zeros_like(q)
    with pytest.raises(ValueError, match="outside its block table or the cache"):
        call.run(np.array([[1, 2]], dtype=np.int32), np.array([100], dtype=np.int32), q, out)  # 4 blocks needed
    with pytest.raises(ValueError, match="outside its block table or the cache"):
        call.run(np.array([[BLOCKS]], dtype=np.int32), np.array([5], dtype=np.int32), q, out)
    assert not out.any()  # nothing written
    with pytest.raises(ValueError, match="contiguous heads"):
        call.run(np.array([[1]], dtype=np.int32), np.array([5], dtype=np.int32), q.transpose(1, 2).contiguous()
                 .transpose(1, 2), out)
    with pytest.raises(ValueError, match="needs pool"):
        DecodeProgram("pages", units=2, unit=16, mode="bound", page_size=16)
    pool = torch.zeros(BLOCKS, HKV, 2, 2, D)
    with pytest.raises(ValueError, match="'blocks_bound' needs page_size >= 1"):
        DecodeProgram("blocks_bound", units=2, unit=16, pool=pool)
    for kind, mode in (("pages", None), ("pages", "max"), ("blocks_exact", "sign"), ("streaming", "bound")):
        with pytest.raises(ValueError, match=f"decode program '{kind}' takes mode"):
            DecodeProgram(kind, units=2, unit=16, mode=mode, pool=pool, page_size=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["vllm-cpu", "rows"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_device_path_equals_native(name, layout, dtype):
    """The fixed-shape torch path (``device.py``, what a CUDA graph captures) on the CPU: the same
    positions, outputs and pools as the kernel, with a padding row of length 0 that reads nothing,
    writes nothing and gets zeros."""
    from kvsieve.kernels.decode_layer.device import decode_layer_device

    k, v, table, lens, program, q, index = _case(name, layout, dtype, 4, len(LENS) + 1)
    per = table.shape[1]
    twin = _twin(program)
    out = torch.empty(len(LENS), HKV * G, D, dtype=torch.float32)
    attended = DecodeLayerCall(k, v, program, num_q_heads=HKV * G, sm_scale=D ** -0.5).run(
        table, lens, q[:-1], out, None if index is None else IndexerStep(index.q[:-1], index.weights[:-1],
                                                                          index.keys[:-1]))
    pad_table = torch.from_numpy(np.concatenate([table, np.zeros((1, per), dtype=np.int32)]))  # block 0: unused
    pad_lens = torch.from_numpy(np.concatenate([lens, [0]]).astype(np.int32))
    got = torch.full((len(LENS) + 1, HKV * G, D), 5.0)
    got_attended = decode_layer_device(k, v, twin, pad_table, pad_lens, q, got, sm_scale=D ** -0.5, index=index)
    np.testing.assert_array_equal(got_attended[:-1].numpy(), attended)
    assert int(got_attended[-1].sum()) == 0 and not got[-1].any()
    torch.testing.assert_close(got[:-1], out, rtol=2e-5, atol=2e-5)
    for mine, ref in ((twin.pool, program.pool), (twin.index_keys, program.index_keys)):
        if mine is not None:
            assert torch.equal(mine.float().nan_to_num(7.0), ref.float().nan_to_num(7.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [128, 512, 40])
@pytest.mark.parametrize("geometry", [(HKV, G, D), (1, 4, 256)], ids=["small", "gemma3"])
@pytest.mark.parametrize("spec", [dict(kind="indexer", units=150), dict(kind="tokens_exact", units=90),
                                  dict(kind="tokens_exact", units=12, unit=8)], ids=["indexer", "tokens", "units-8"])
def test_scattered_tokens_on_k_by_channel(spec, geometry, block_size, dtype):
    """Scattered selections on vLLM's layout with blocks of 128 and 512 tokens (this file's geometry and
    Gemma 3's, 1 KV head x 4, head dim 256): the kernel reads each block's selected tokens as spans of
    at most 256, by the 16-token tiles of the block's grid that hold a selected token (four at a time,
    one at a time, a tile starting before its span); with blocks of 40 (channel rows off that grid) by
    tiles from each span's start and a cut last tile; and attends the selected tokens alone; the
    indexer's 32-channel keys take the 16 x 16 transposed tiles (the other tests' 16 channels in bf16,
    and the rows' last tiles, the one-position path): the
    positions and outputs of the plain-PyTorch twin."""
    hkv, g, d = geometry
    gen = torch.Generator().manual_seed(5)
    lens = np.array([1500, 700, 260], dtype=np.int32)
    per = -(-int(lens.max()) // block_size)
    n_blocks = 3 * per
    raw = torch.randn(n_blocks, hkv, d, block_size, generator=gen).to(dtype)
    k, v = raw.transpose(2, 3), torch.randn(n_blocks, hkv, block_size, d, generator=gen).to(dtype)
    table = torch.randperm(n_blocks, generator=gen)[: 3 * per].numpy().astype(np.int32).reshape(3, per)
    index_keys = torch.randn(n_blocks, block_size, 32, generator=gen).to(dtype) if spec["kind"] == "indexer" else None
    program = DecodeProgram(**spec, index_keys=index_keys)
    q = torch.randn(3, hkv * g, d, generator=gen).to(dtype)
    index = None
    if index_keys is not None:
        index = IndexerStep(torch.randn(3, 4, 32, generator=gen).to(dtype).float(), torch.rand(3, 4, generator=gen) + 0.1,
                            torch.randn(3, 32, generator=gen))
    twin = _twin(program)
    out = torch.empty(3, hkv * g, d, dtype=torch.float32)
    attended = DecodeLayerCall(k, v, program, num_q_heads=hkv * g, sm_scale=d ** -0.5).run(table, lens, q, out, index)
    want, want_attended = decode_layer_naive(k, v, twin, table, lens, q, sm_scale=d ** -0.5, index=index)
    np.testing.assert_array_equal(attended, want_attended)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    assert (attended < lens[:, None]).all()  # every row skipped tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("index_heads", [1, 8, 12, 17])
def test_indexer_heads_in_passes(index_heads, dtype):
    """The indexer's score sums its heads in order while one pass over a tile's channels feeds up to 8
    heads' dot products (whole passes of 8, a last shorter one, or one short pass): the positions and
    outputs of the plain-PyTorch twin, the index keys written equal."""
    k, v, table, lens, program, q, _ = _case("indexer", "vllm-cpu", dtype, 11, len(LENS))
    twin = _twin(program)
    gen = torch.Generator().manual_seed(12)
    channels = program.index_keys.shape[-1]
    index = IndexerStep(torch.randn(len(LENS), index_heads, channels, generator=gen).to(dtype).float(),
                        torch.rand(len(LENS), index_heads, generator=gen) + 0.1,
                        torch.randn(len(LENS), channels, generator=gen))
    out = torch.empty(len(LENS), HKV * G, D, dtype=torch.float32)
    attended = DecodeLayerCall(k, v, program, num_q_heads=HKV * G, sm_scale=D ** -0.5).run(table, lens, q, out, index)
    want, want_attended = decode_layer_naive(k, v, twin, table, lens, q, sm_scale=D ** -0.5, index=index)
    np.testing.assert_array_equal(attended, want_attended)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    assert torch.equal(program.index_keys.float(), twin.index_keys.float())
    assert (attended < lens[:, None]).any()


LONG_LENS = (2500, 1100, 1800)  # past the kernel's one-thread cutoff (TEAM_MIN_LEN, 1024 positions)


@pytest.mark.parametrize("threads,rows", [(2, 1), (3, 2), (2, 3)], ids=["team-of-2", "team-of-3", "a-row-a-thread"])
@pytest.mark.parametrize("layout", ["vllm-cpu", "rows"])
@pytest.mark.parametrize("name", ["indexer", "streaming", "pages-bound", "tokens", "blocks-max"])
def test_threads_equal_naive(name, layout, threads, rows):
    """With fewer rows than threads each row's team shares it (the indexer's score tiles split, each
    head's runs cut into a part a thread, the parts merged by their log-sum-exp); with at least as many
    rows, each thread takes whole rows. Either way the plain-PyTorch twin's positions, its outputs to
    fp32 rounding and its pools bit for bit. A team's output is not one thread's bit for bit (its parts
    were merged: the split ran); a row a thread's is."""
    k, v, table, lens, program, q, index = _case(name, layout, torch.float32, 13, rows, LONG_LENS)
    table, lens = table[:rows], lens[:rows]
    twin, alone = _twin(program), _twin(program)
    outs, attended = {}, {}
    for n_threads, prog in ((threads, program), (1, alone)):
        outs[n_threads] = torch.empty(rows, HKV * G, D)
        attended[n_threads] = DecodeLayerCall(k, v, prog, num_q_heads=HKV * G, sm_scale=D ** -0.5,
                                              threads=n_threads).run(table, lens, q, outs[n_threads], index)
    want, want_attended = decode_layer_naive(k, v, twin, table, lens, q, sm_scale=D ** -0.5, index=index)
    np.testing.assert_array_equal(attended[threads], want_attended)
    np.testing.assert_array_equal(attended[1], want_attended)
    torch.testing.assert_close(outs[threads], want, rtol=2e-5, atol=2e-5)
    for got, ref in ((program.pool, twin.pool), (program.index_keys, twin.index_keys)):
        if got is not None:
            assert torch.equal(got.float().nan_to_num(7.0), ref.float().nan_to_num(7.0))
    assert torch.equal(outs[threads], outs[1]) == (rows >= threads)
    assert (want_attended < lens[:, None]).all()



def _index_scores(program: DecodeProgram, table: np.ndarray, lens: np.ndarray, index: IndexerStep
                  ) -> list[torch.Tensor]:
    """Each row's indexer scores of its positions, its new key in place (the plain formula)."""
    scores = []
    for r, length in enumerate(lens.tolist()):
        keys = torch.stack([program.index_keys[int(table[r, p // BS]), p % BS] for p in range(length)]).float()
        keys[-1] = index.keys[r].to(program.index_keys.dtype).float()
        scores.append((index.weights[r][:, None] * (index.q[r] @ keys.T).relu()).sum(0))
    return scores


@pytest.mark.parametrize("units", [300, 700, 2999, "tie-group-end"])
def test_indexer_top_k_through_exact_ties(units):
    """Index keys and queries of -1, 0 and 1 with unit weights give integer scores, so hundreds of
    positions tie at the k-th score, and many at 0 (relu): the kernel's top-k (a radix select over
    digits of the scores' order keys, then a quickselect among the few left) keeps the lower positions
    of a tie, as the plain-PyTorch twin does; also with k ending a tie group of the first row (the
    positions above its score plus all of its ties). Rows past the select's 256-key cutoff."""
    gen = torch.Generator().manual_seed(21)
    lens = np.array([3000, 1300], dtype=np.int32)
    per = -(-int(lens.max()) // BS)
    k, v = _cache("vllm-cpu", torch.float32, gen, 2 * per + 1)
    table = (torch.randperm(2 * per, generator=gen).numpy().astype(np.int32) + 1).reshape(2, per)
    index_keys = torch.randint(-1, 2, (2 * per + 1, BS, 32), generator=gen).to(torch.bfloat16)
    index = IndexerStep(torch.randint(-1, 2, (2, 4, 32), generator=gen).float(), torch.ones(2, 4),
                        torch.randint(-1, 2, (2, 32), generator=gen).float())
    scores = _index_scores(DecodeProgram(kind="indexer", units=1, index_keys=index_keys), table, lens, index)
    if units == "tie-group-end":
        units = int((scores[0] >= scores[0].median()).sum())
    for score in scores:  # the k-th score ties
        assert (score == score.sort(descending=True).values[min(units, len(score)) - 1]).sum() > 1
    program = DecodeProgram(kind="indexer", units=units, index_keys=index_keys)
    q = torch.randn(2, HKV * G, D, generator=gen)
    twin = _twin(program)
    out = torch.empty(2, HKV * G, D)
    attended = DecodeLayerCall(k, v, program, num_q_heads=HKV * G, sm_scale=D ** -0.5).run(table, lens, q, out, index)
    want, want_attended = decode_layer_naive(k, v, twin, table, lens, q, sm_scale=D ** -0.5, index=index)
    np.testing.assert_array_equal(attended, want_attended)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)


def test_indexer_q_off_the_bf16_grid_is_scored_in_fp32():
    """A bf16 key pool scored with a q that is not made of bf16 values: the kernel's bf16-pair pass (CPUs
    with AVX512-BF16) would drop q's low bits, so it must fall back to fp32. Position 3's key is channel 1
    and position 20's channel 0; q's channel 0 is 1 + 2^-12 (1 in bf16) and channel 1 is 1, so only an
    fp32 score keeps 20 above 3 (dropped bits tie them, and the tie keeps 3)."""
    gen = torch.Generator().manual_seed(5)
    lens = np.array([64], dtype=np.int32)
    k, v = _cache("vllm-cpu", torch.float32, gen, 3)
    table = np.array([[2, 1]], dtype=np.int32)
    index_keys = torch.zeros(3, BS, 32, dtype=torch.bfloat16)
    index_keys[2, 3, 1] = 1.0
    index_keys[2, 20, 0] = 1.0
    iq = torch.zeros(1, 1, 32)
    iq[0, 0, 0], iq[0, 0, 1] = 1.0 + 2.0 ** -12, 1.0
    index = IndexerStep(iq, torch.ones(1, 1), torch.zeros(1, 32))
    program = DecodeProgram(kind="indexer", units=1, index_keys=index_keys)
    q = torch.randn(1, HKV * G, D, generator=gen)
    out = torch.empty(1, HKV * G, D)
    DecodeLayerCall(k, v, program, num_q_heads=HKV * G, sm_scale=D ** -0.5).run(table, lens, q, out, index)
    want, _ = decode_layer_naive(k, v, _twin(program), table, lens, q, sm_scale=D ** -0.5, index=index)
    v20 = v[2, :, 20].repeat_interleave(G, dim=0)  # the one position attended: out is its V row
    torch.testing.assert_close(want[0], v20, rtol=0, atol=0)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
