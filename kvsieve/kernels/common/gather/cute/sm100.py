"""SM100 (Blackwell, ``sm_100a``) sparse gather-attention decode kernel: ``tcgen05`` MMA + TMEM.

Same work split and contract as ``sm90.GatherAttentionSm90`` (see there), with the SM100 pieces:

* 128 query rows per CTA (the ``tcgen05.mma`` cta_group::1 M=128 shape); MLA with 64 heads or a
  GQA group < 128 pads the rows with zero queries and never stores them;
* ``S = Q K^T`` and ``O += P V`` accumulate in tensor memory (S: ``BN`` columns at column 0,
  O: ``dv_tile`` = 256 fp32 columns at column 256, 512 columns allocated);
* one elected thread of warp 0 issues the MMAs and ``tcgen05.commit``s them to an mbarrier;
  all 128 threads wait on it, load their own S row with ``tcgen05.ld`` 32x32b (thread i owns
  row i, so row max/sum need no shuffles), write P (bf16) to shared memory as the A operand of
  the PV MMA, and rescale their O row in TMEM (``tcgen05.ld``/``st``) when the max moved;
* ``BN = 32`` KV rows per tile so that Q (144 KiB for MLA) + K tile + P fit in 227 KiB.

No ``from __future__ import annotations``: the DSL reads ``cutlass.Constexpr`` annotations at
trace time.
"""
import math

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import tcgen05
from cutlass.experimental.primitives.nvvm_wrapper import tcgen05_fence

from .tile_ops import load_q_rows, row_tile_layout, stage_kv_tile, v_view_layout

BF16 = cutlass.BFloat16
F32 = cutlass.Float32
LN2 = math.log(2.0)
O_TMEM_COL = 256
CHUNK = 32  # TMEM columns per tcgen05.ld/st of the O accumulator


@cute.struct
class _Barriers:
    mma_done: cute.struct.MemRange[cutlass.Int64, 1]
    tmem_holding: cutlass.Int32


class GatherAttentionSm100:
    """Static configuration of the SM100 kernel; arguments as ``GatherAttentionSm90``."""

    m_rows = 128
    threads = 128

    def __init__(self, d_qk: int, d_v: int, dv_tile: int, group: int, num_kv_heads: int,
                 block_n: int = 32, v_in_k: bool = True, kv_fp8: bool = False):
        self.d_qk, self.d_v, self.dv_tile = d_qk, d_v, dv_tile
        self.group, self.num_kv_heads, self.block_n = group, num_kv_heads, block_n
        self.v_in_k, self.kv_fp8 = v_in_k, kv_fp8
        self.head_blocks = -(-group // self.m_rows)
        self.v_tiles = d_v // dv_tile
        b = 2 * (self.m_rows * d_qk + block_n * d_qk + self.m_rows * block_n)
        if not v_in_k:
            b += 2 * block_n * d_v
        self.smem_size = b + 4 * block_n + 64 + 4 * 1024

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, k_ptr: cute.Pointer, v_ptr: cute.Pointer,
                 idx_ptr: cute.Pointer, o_ptr: cute.Pointer, lse_ptr: cute.Pointer,
                 num_tokens: cutlass.Int32, sel_len: cutlass.Int32, num_splits: cutlass.Int32,
                 tiles_per_split: cutlass.Int32, q_tok_stride: cutlass.Int64,
                 q_head_stride: cutlass.Int64, k_row_elems: cutlass.Constexpr,
                 v_row_elems: cutlass.Constexpr, scale_log2: cutlass.Float32,
                 stream):
        M, BN, DVT = self.m_rows, self.block_n, self.dv_tile
        mma_s = cute.make_tiled_mma(tcgen05.MmaF16BF16Op(
            BF16, F32, (M, BN, 16), tcgen05.CtaGroup.ONE, tcgen05.OperandSource.SMEM,
            tcgen05.OperandMajorMode.K, tcgen05.OperandMajorMode.K))
        mma_o = cute.make_tiled_mma(tcgen05.MmaF16BF16Op(
            BF16, F32, (M, DVT, 16), tcgen05.CtaGroup.ONE, tcgen05.OperandSource.SMEM,
            tcgen05.OperandMajorMode.K, tcgen05.OperandMajorMode.MN))
        grid = (num_tokens * self.num_kv_heads * self.head_blocks, self.v_tiles, num_splits)
        self.kernel(mma_s, mma_o, q_ptr, k_ptr, v_ptr, idx_ptr, o_ptr, lse_ptr, num_tokens,
                    sel_len, tiles_per_split, q_tok_stride, q_head_stride, k_row_elems,
                    v_row_elems, scale_log2).launch(
            grid=grid, block=(self.threads, 1, 1), smem=self.smem_size, stream=stream)

    @cute.kernel
    def kernel(self, mma_s: cute.TiledMma, mma_o: cute.TiledMma, q_ptr: cute.Pointer,
               k_ptr: cute.Pointer, v_ptr: cute.Pointer, idx_ptr: cute.Pointer,
               o_ptr: cute.Pointer, lse_ptr: cute.Pointer, num_tokens: cutlass.Int32,
               sel_len: cutlass.Int32, tiles_per_split: cutlass.Int32,
               q_tok_stride: cutlass.Int64, q_head_stride: cutlass.Int64,
               k_row_elems: cutlass.Constexpr, v_row_elems: cutlass.Constexpr,
               scale_log2: cutlass.Float32):
        M, BN, DQK, DVT = self.m_rows, self.block_n, self.d_qk, self.dv_tile
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bx, vt, split = cute.arch.block_idx()
        hb = bx % self.head_blocks
        kvh = (bx // self.head_blocks) % self.num_kv_heads
        token = bx // (self.head_blocks * self.num_kv_heads)
        head0 = kvh * self.group + hb * M
        rows_valid = cutlass.min(self.group - hb * M, M)

        smem = cutlass.utils.SmemAllocator()
        bars = smem.allocate(_Barriers)
        q_layout = row_tile_layout(M, DQK)
        k_layout = row_tile_layout(BN, DQK)
        p_layout = row_tile_layout(M, BN)
        sQ = smem.allocate_tensor(BF16, q_layout.outer, 1024, q_layout.inner)
        sK = smem.allocate_tensor(BF16, k_layout.outer, 1024, k_layout.inner)
        sP = smem.allocate_tensor(BF16, p_layout.outer, 1024, p_layout.inner)
        v_base = sK
        if cutlass.const_expr(not self.v_in_k):
            vr_layout = row_tile_layout(BN, self.d_v)
            v_base = smem.allocate_tensor(BF16, vr_layout.outer, 1024, vr_layout.inner)
        sRow = smem.allocate_tensor(cutlass.Int32, cute.make_layout(BN), 16)
        vv_layout = v_view_layout(DVT, BN)
        sV = cute.make_tensor(v_base.iterator + vt * DVT * BN, vv_layout.outer)
        mbar = bars.mma_done.data_ptr()
        if tidx == 0:
            cute.arch.mbarrier_init(mbar, 1)
        cute.arch.mbarrier_init_fence()

        tmem = utils.TmemAllocator(bars.tmem_holding.ptr, barrier_for_retrieve=pipeline.NamedBarrier(
            barrier_id=1, num_threads=self.threads))
        tmem.allocate(512)

        load_q_rows(q_ptr, q_tok_stride, q_head_stride, token, head0, rows_valid, sQ, tidx, M,
                    DQK, self.threads)

        thr_s = mma_s.get_slice(0)
        thr_o = mma_o.get_slice(0)
        tSrQ = mma_s.make_fragment_A(thr_s.partition_A(sQ))
        tSrK = mma_s.make_fragment_B(thr_s.partition_B(sK))
        tOrP = mma_o.make_fragment_A(thr_o.partition_A(sP))
        tOrV = mma_o.make_fragment_B(thr_o.partition_B(sV))
        s_frag = mma_s.make_fragment_C(mma_s.partition_shape_C((M, BN)))
        o_frag = mma_o.make_fragment_C(mma_o.partition_shape_C((M, DVT)))

        tmem.wait_for_alloc()
        tmem_ptr = tmem.retrieve_ptr(F32)
        tS = cute.make_tensor(tmem_ptr, s_frag.layout)
        tO = cute.make_tensor(tmem_ptr + O_TMEM_COL, o_frag.layout)

        # per-thread TMEM views: S row (BN columns) and O row chunks (CHUNK columns)
        s_ld = tcgen05.make_tmem_copy(cute.make_copy_atom(
            tcgen05.Ld32x32bOp(tcgen05.Repetition(BN)), F32), tS[(None, None), 0, 0])
        thr_s_ld = s_ld.get_slice(tidx)
        tS_src = thr_s_ld.partition_S(tS[(None, None), 0, 0])
        tS_crd = thr_s_ld.partition_D(cute.make_identity_tensor((M, BN)))
        r_s = cute.make_rmem_tensor(tS_crd.shape, F32)

        o_chunk_layout = cute.composition(tO[(None, None), 0, 0].layout,
                                          cute.make_layout((M, CHUNK)))
        o_chunk = cute.make_tensor(tO.iterator, o_chunk_layout)
        o_ld = tcgen05.make_tmem_copy(cute.make_copy_atom(
            tcgen05.Ld32x32bOp(tcgen05.Repetition(CHUNK)), F32), o_chunk)
        o_st = tcgen05.make_tmem_copy(cute.make_copy_atom(
            tcgen05.St32x32bOp(tcgen05.Repetition(CHUNK)), F32), o_chunk)
        thr_o_ld = o_ld.get_slice(tidx)
        thr_o_st = o_st.get_slice(tidx)
        tO_src = thr_o_ld.partition_S(o_chunk)
        tO_dst = thr_o_st.partition_D(o_chunk)
        tO_crd = thr_o_ld.partition_D(cute.make_identity_tensor((M, CHUNK)))
        r_o = cute.make_rmem_tensor(tO_crd.shape, F32)

        # zero the O accumulator (PV MMAs always accumulate)
        r_o.fill(0.0)
        for c in cutlass.range_constexpr(DVT // CHUNK):
            cute.copy(o_st, r_o, cute.make_tensor(tO_dst.iterator + c * CHUNK, tO_dst.layout))
        cute.arch.fence_view_async_tmem_store()
        tcgen05_fence("before_thread_sync")

        row = tS_crd[0][0]
        row_max = -F32.inf
        row_sum = F32(0.0)
        phase = cutlass.Int32(0)

        n_tiles = sel_len // BN
        t_begin = split * tiles_per_split
        t_end = cutlass.min(t_begin + tiles_per_split, n_tiles)
        idx_row = (token * self.num_kv_heads + kvh) * sel_len
        for tile in cutlass.range(t_begin, t_end, 1):
            stage_kv_tile(idx_ptr, idx_row + tile * BN, tidx, sRow, k_ptr, k_row_elems, DQK, sK, v_ptr,
                          v_row_elems, self.d_v, v_base, self.kv_fp8, self.v_in_k, BN, self.threads)

            if warp == 0:
                tcgen05_fence("after_thread_sync")
                for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                    mma_s.set(tcgen05.Field.ACCUMULATE, kb != 0)
                    cute.gemm(mma_s, tS, tSrQ[None, None, kb], tSrK[None, None, kb], tS)
                with cute.arch.elect_one():
                    tcgen05.commit(mbar)
            cute.arch.mbarrier_wait(mbar, phase)
            phase = phase ^ 1
            tcgen05_fence("after_thread_sync")

            cute.copy(s_ld, tS_src, r_s)
            cute.arch.fence_view_async_tmem_load()
            tile_max = -F32.inf
            for i in cutlass.range_constexpr(cute.size(r_s)):
                s2 = r_s[i] * scale_log2
                if sRow[tS_crd[i][1]] < 0:
                    s2 = -F32.inf
                r_s[i] = s2
                tile_max = cute.arch.fmax(tile_max, s2)
            new_max = cute.arch.fmax(row_max, tile_max)
            use = new_max
            if new_max == -F32.inf:
                use = F32(0.0)
            alpha = cute.math.exp2(row_max - use, fastmath=True)
            row_max = new_max
            row_sum = row_sum * alpha
            p_row = sP[row, None]
            for i in cutlass.range_constexpr(cute.size(r_s)):
                p = cute.math.exp2(r_s[i] - use, fastmath=True)
                row_sum = row_sum + p
                p_row[tS_crd[i][1]] = p.to(BF16)
            if alpha != 1.0:
                for c in cutlass.range_constexpr(DVT // CHUNK):
                    cute.copy(o_ld, cute.make_tensor(tO_src.iterator + c * CHUNK, tO_src.layout),
                              r_o)
                    for i in cutlass.range_constexpr(cute.size(r_o)):
                        r_o[i] = r_o[i] * alpha
                    cute.copy(o_st, r_o,
                              cute.make_tensor(tO_dst.iterator + c * CHUNK, tO_dst.layout))
                cute.arch.fence_view_async_tmem_store()
            cute.arch.fence_proxy("async.shared", space="cta")
            tcgen05_fence("before_thread_sync")
            cute.arch.sync_threads()

            if warp == 0:
                tcgen05_fence("after_thread_sync")
                mma_o.set(tcgen05.Field.ACCUMULATE, True)
                for kb in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                    cute.gemm(mma_o, tO, tOrP[None, None, kb], tOrV[None, None, kb], tO)
                with cute.arch.elect_one():
                    tcgen05.commit(mbar)
            cute.arch.mbarrier_wait(mbar, phase)
            phase = phase ^ 1
            tcgen05_fence("after_thread_sync")

        # epilogue: O row / l, natural-log LSE; empty rows -> 0 / +inf
        inv = F32(0.0)
        lse = F32.inf
        if row_sum > 0.0:
            inv = 1.0 / row_sum
            lse = (row_max + cute.math.log2(row_sum, fastmath=True)) * LN2
        hq_total = self.group * self.num_kv_heads
        o_row = (split * num_tokens + token) * hq_total + head0 + row
        g_o = cute.make_tensor(o_ptr, cute.make_layout((1 << 30, self.d_v), stride=(self.d_v, 1)))
        for c in cutlass.range_constexpr(DVT // CHUNK):
            cute.copy(o_ld, cute.make_tensor(tO_src.iterator + c * CHUNK, tO_src.layout), r_o)
            if row < rows_valid:
                for i in cutlass.range_constexpr(cute.size(r_o)):
                    g_o[o_row, vt * DVT + c * CHUNK + tO_crd[i][1]] = r_o[i] * inv
        if vt == 0:
            if row < rows_valid:
                g_l = cute.make_tensor(lse_ptr, cute.make_layout(1 << 30))
                g_l[o_row] = lse

        tmem.relinquish_alloc_permit()
        cute.arch.sync_threads()
        tmem.free(tmem_ptr)
