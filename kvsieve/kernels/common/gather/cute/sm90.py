"""SM90 (Hopper, ``sm_90a``) sparse gather-attention decode kernel: warpgroup MMA (wgmma).

One CTA = one warpgroup (128 threads) = one (query token, KV head, block of 64 query heads,
value-column tile, split). Per tile of ``BN`` selected KV rows it

1. gathers the rows (one row id per tile row; -1 = masked) into shared memory, dequantizing
   FP8 rows on the way (``tile_ops``), then fences the generic->async proxy;
2. ``S = Q K^T`` with ``wgmma.mma_async`` m64nBNk16, A = the 64 staged query heads (smem),
   B = the gathered tile (smem, K-major);
3. online softmax in registers (fp32, log2 domain, quad shuffles for the row reductions);
4. ``O += P V`` with ``wgmma`` m64n``dv_tile``k16, A = P converted to bf16 **in registers**
   (the m64 accumulator layout is the A-fragment layout), B = the same smem tile seen MN-major
   (for MLA V is the first 512 latent columns: no second copy).

The [64, 512] fp32 MLA accumulator does not fit one warpgroup's registers, so the 512 value
columns are split over two CTAs (``dv_tile = 256``, 128 accumulator registers per thread);
each recomputes ``S`` (about 1.5x the MMA work of a fused kernel; see docs/kernels.md (CuTe-DSL section)).
Partial results go to ``out_partial [splits, T, H, Dv]`` fp32 and ``lse_partial [splits, T, H]``
(natural log; empty -> out 0, lse +inf); the host merges splits.

No ``from __future__ import annotations``: the DSL reads ``cutlass.Constexpr`` annotations at
trace time.
"""
import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup

from .tile_ops import load_q_rows, row_tile_layout, stage_kv_tile, v_view_layout

BF16 = cutlass.BFloat16
F32 = cutlass.Float32
LN2 = math.log(2.0)


class GatherAttentionSm90:
    """Static configuration of the SM90 kernel (one compiled variant per instance).

    Args:
        d_qk: query/key width (576 for MLA, the head dim for GQA); multiple of 64.
        d_v: value width (512 for MLA); multiple of ``dv_tile``.
        dv_tile: value columns per CTA (<= 256, multiple of 64).
        group: query heads per KV head (MLA: all heads; GQA: the group size).
        num_kv_heads: KV heads (1 for MLA).
        block_n: KV rows per tile (64).
        v_in_k: V is the first ``d_v`` columns of the gathered K row (MLA latent).
        kv_fp8: K rows are FlashMLA 656-byte FP8 rows (MLA only).
    """

    m_rows = 64
    threads = 128

    def __init__(self, d_qk: int, d_v: int, dv_tile: int, group: int, num_kv_heads: int,
                 block_n: int = 64, v_in_k: bool = True, kv_fp8: bool = False):
        self.d_qk, self.d_v, self.dv_tile = d_qk, d_v, dv_tile
        self.group, self.num_kv_heads, self.block_n = group, num_kv_heads, block_n
        self.v_in_k, self.kv_fp8 = v_in_k, kv_fp8
        self.head_blocks = -(-group // self.m_rows)
        self.v_tiles = d_v // dv_tile
        # dynamic smem: Q + K tile [+ V tile] + row ids, plus 1 KiB alignment slack per buffer
        b = 2 * (self.m_rows * d_qk + block_n * d_qk)
        if not v_in_k:
            b += 2 * block_n * d_v
        self.smem_size = b + 4 * block_n + 3 * 1024

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, k_ptr: cute.Pointer, v_ptr: cute.Pointer,
                 idx_ptr: cute.Pointer, o_ptr: cute.Pointer, lse_ptr: cute.Pointer,
                 num_tokens: cutlass.Int32, sel_len: cutlass.Int32, num_splits: cutlass.Int32,
                 tiles_per_split: cutlass.Int32, q_tok_stride: cutlass.Int64,
                 q_head_stride: cutlass.Int64, k_row_elems: cutlass.Constexpr,
                 v_row_elems: cutlass.Constexpr, scale_log2: cutlass.Float32,
                 stream):
        mma_s = sm90_utils.make_trivial_tiled_mma(
            BF16, BF16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, F32,
            (1, 1, 1), (self.m_rows, self.block_n))
        mma_o = sm90_utils.make_trivial_tiled_mma(
            BF16, BF16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, F32,
            (1, 1, 1), (self.m_rows, self.dv_tile), warpgroup.OperandSource.RMEM)
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
        bx, vt, split = cute.arch.block_idx()
        hb = bx % self.head_blocks
        kvh = (bx // self.head_blocks) % self.num_kv_heads
        token = bx // (self.head_blocks * self.num_kv_heads)
        head0 = kvh * self.group + hb * M
        rows_valid = cutlass.min(self.group - hb * M, M)

        smem = cutlass.utils.SmemAllocator()
        q_layout = row_tile_layout(M, DQK)
        k_layout = row_tile_layout(BN, DQK)
        sQ = smem.allocate_tensor(BF16, q_layout.outer, 1024, q_layout.inner)
        sK = smem.allocate_tensor(BF16, k_layout.outer, 1024, k_layout.inner)
        v_base = sK
        if cutlass.const_expr(not self.v_in_k):
            vr_layout = row_tile_layout(BN, self.d_v)
            v_base = smem.allocate_tensor(BF16, vr_layout.outer, 1024, vr_layout.inner)
        sRow = smem.allocate_tensor(cutlass.Int32, cute.make_layout(BN), 16)
        vv_layout = v_view_layout(DVT, BN)
        sV = cute.make_tensor(v_base.iterator + vt * DVT * BN, vv_layout.outer)

        load_q_rows(q_ptr, q_tok_stride, q_head_stride, token, head0, rows_valid, sQ, tidx, M,
                    DQK, self.threads)

        thr_s = mma_s.get_slice(tidx)
        thr_o = mma_o.get_slice(tidx)
        tSrQ = thr_s.make_fragment_A(thr_s.partition_A(sQ))
        tSrK = thr_s.make_fragment_B(thr_s.partition_B(sK))
        tOrV = thr_o.make_fragment_B(thr_o.partition_B(sV))
        acc_s = thr_s.make_fragment_C(thr_s.partition_shape_C((M, BN)))
        acc_o = thr_o.make_fragment_C(thr_o.partition_shape_C((M, DVT)))
        acc_o.fill(0.0)
        r_p = cute.make_rmem_tensor(thr_o.partition_shape_A((M, BN)), BF16)
        r_p_as_s = cute.make_tensor(r_p.iterator, acc_s.layout)
        t_cs = thr_s.partition_C(cute.make_identity_tensor((M, BN)))

        row_max = cute.make_rmem_tensor(cute.make_layout(2), F32)
        row_sum = cute.make_rmem_tensor(cute.make_layout(2), F32)
        row_max.fill(-F32.inf)
        row_sum.fill(0.0)

        n_tiles = sel_len // BN
        t_begin = split * tiles_per_split
        t_end = cutlass.min(t_begin + tiles_per_split, n_tiles)
        idx_row = (token * self.num_kv_heads + kvh) * sel_len
        for tile in cutlass.range(t_begin, t_end, 1):
            stage_kv_tile(idx_ptr, idx_row + tile * BN, tidx, sRow, k_ptr, k_row_elems, DQK, sK, v_ptr,
                          v_row_elems, self.d_v, v_base, self.kv_fp8, self.v_in_k, BN, self.threads)

            warpgroup.fence()
            for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                mma_s.set(warpgroup.Field.ACCUMULATE, kb != 0)
                cute.gemm(mma_s, acc_s, tSrQ[None, None, kb], tSrK[None, None, kb], acc_s)
            warpgroup.commit_group()
            warpgroup.wait_group(0)

            # online softmax; accumulator value i: col pair i%2, row half (i//2)%2, col block i//4
            new_max = cute.make_rmem_tensor(cute.make_layout(2), F32)
            new_max.fill(-F32.inf)
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                col = t_cs[i][1]
                s2 = acc_s[i] * scale_log2
                if sRow[col] < 0:
                    s2 = -F32.inf
                acc_s[i] = s2
                h = (i // 2) % 2
                new_max[h] = cute.arch.fmax(new_max[h], s2)
            alpha = cute.make_rmem_tensor(cute.make_layout(2), F32)
            for h in cutlass.range_constexpr(2):
                mx = cute.arch.warp_reduction_max(new_max[h], threads_in_group=4)
                mx = cute.arch.fmax(mx, row_max[h])
                use = mx
                if mx == -F32.inf:
                    use = 0.0
                alpha[h] = cute.math.exp2(row_max[h] - use, fastmath=True)
                row_max[h] = mx
                new_max[h] = use
                row_sum[h] = row_sum[h] * alpha[h]
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                h = (i // 2) % 2
                p = cute.math.exp2(acc_s[i] - new_max[h], fastmath=True)
                acc_s[i] = p
                row_sum[h] = row_sum[h] + p
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                acc_o[i] = acc_o[i] * alpha[(i // 2) % 2]
            r_p_as_s.store(acc_s.load().to(BF16))

            warpgroup.fence()
            mma_o.set(warpgroup.Field.ACCUMULATE, True)
            for kb in cutlass.range_constexpr(cute.size(tOrV, mode=[2])):
                cute.gemm(mma_o, acc_o, r_p[None, None, kb], tOrV[None, None, kb], acc_o)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            cute.arch.sync_threads()

        # epilogue: normalise, natural-log LSE, empty rows -> 0 / +inf
        inv = cute.make_rmem_tensor(cute.make_layout(2), F32)
        lse = cute.make_rmem_tensor(cute.make_layout(2), F32)
        for h in cutlass.range_constexpr(2):
            tot = cute.arch.warp_reduction_sum(row_sum[h], threads_in_group=4)
            inv[h] = 0.0
            lse[h] = F32.inf
            if tot > 0.0:
                inv[h] = 1.0 / tot
                lse[h] = (row_max[h] + cute.math.log2(tot, fastmath=True)) * LN2
        split_idx = cute.arch.block_idx()[2]
        hq_total = self.group * self.num_kv_heads
        o_row0 = (split_idx * num_tokens + token) * hq_total + head0
        t_co = thr_o.partition_C(cute.make_identity_tensor((M, DVT)))
        g_o = cute.make_tensor(o_ptr, cute.make_layout((1 << 30, self.d_v), stride=(self.d_v, 1)))
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            row = t_co[i][0]
            if row < rows_valid:
                g_o[o_row0 + row, vt * DVT + t_co[i][1]] = acc_o[i] * inv[(i // 2) % 2]
        if vt == 0:
            if tidx % 4 == 0:
                g_l = cute.make_tensor(lse_ptr, cute.make_layout(1 << 30))
                for h in cutlass.range_constexpr(2):
                    row = (tidx // 32) * 16 + (tidx % 32) // 4 + 8 * h
                    if row < rows_valid:
                        g_l[o_row0 + row] = lse[h]
