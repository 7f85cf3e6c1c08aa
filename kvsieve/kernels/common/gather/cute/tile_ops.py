"""Device helpers shared by the SM90 and SM100 sparse gather-attention kernels.

Everything here runs inside ``@cute.kernel`` functions (inlined by the DSL):

* ``gather_rows_bf16`` / ``gather_rows_fp8``: stage one tile of ``BN`` selected KV rows into a
  shared-memory buffer laid out as ``BN`` token rows of 128-byte-swizzled 64-element atoms
  (the K-major SW128 layout of a wgmma/tcgen05 B operand, see ``row_tile_layout``). The FP8
  variant dequantizes FlashMLA's 656-byte token format on the way (512 e4m3 values times one fp32
  scale per 128 values, then 64 bf16 rope values).
* ``row_tile_layout`` / ``v_view_layout``: the same bytes seen as the K-major B operand of
  ``S = Q K^T`` (N = tokens, K = head dim) and as the MN-major B operand of ``O = P V``
  (N = value columns, K = tokens). Both views tile the 8x64 swizzle atom token-block first, so
  atom ``(token_block, dim_block)`` sits at the same byte offset in both; a V column tile
  ``[j*dv_tile, (j+1)*dv_tile)`` starts ``j * dv_tile * BN`` elements into the buffer.

No ``from __future__ import annotations`` here: the DSL's AST preprocessor evaluates the
``cutlass.Constexpr`` annotations of jit functions, which postponed (string) annotations break.
"""
import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warpgroup

BF16 = cutlass.BFloat16
FP8_ROW_BYTES = 656  # 512 e4m3 + 4 fp32 scales + 64 bf16 rope (FlashMLA V3.2 format)
FP8_SCALE_OFFSET = 512
FP8_ROPE_OFFSET = 528


def row_tile_layout(rows: int, cols: int):
    """``(rows, cols)`` bf16 smem layout: K-major swizzle atoms (128 B when ``cols % 64 == 0``,
    else 64 B for the 32-column P tile of SM100), token blocks first."""
    kind = warpgroup.SmemLayoutAtomKind.K_SW128 if cols % 64 == 0 else \
        warpgroup.SmemLayoutAtomKind.K_SW64
    atom = warpgroup.make_smem_layout_atom(kind, BF16)
    return cute.tile_to_shape(atom, (rows, cols), (0, 1))


def v_view_layout(dv_tile: int, rows: int):
    """``(dv_tile, rows)`` MN-major view of a ``row_tile_layout(rows, *)`` buffer (same bytes)."""
    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, BF16)
    return cute.tile_to_shape(atom, (dv_tile, rows), (1, 0))


@cute.jit
def load_row_id(idx_ptr: cute.Pointer, tile_base: cutlass.Int32, tidx: cutlass.Int32,
                block_n: cutlass.Constexpr, threads: cutlass.Constexpr):
    """Row id of the tile row owned by ``tidx`` (``threads // block_n`` threads per row)."""
    tpr = threads // block_n
    r = tidx // tpr
    g = cute.make_tensor(idx_ptr + tile_base, cute.make_layout(block_n))
    return g[r]


@cute.jit
def gather_rows_bf16(src_ptr: cute.Pointer, row_elems: cutlass.Constexpr,
                     width: cutlass.Constexpr, sDst: cute.Tensor, row_id: cutlass.Int32,
                     tidx: cutlass.Int32, block_n: cutlass.Constexpr,
                     threads: cutlass.Constexpr):
    """Copy columns ``[0, width)`` of row ``row_id`` of a ``[*, row_elems]`` bf16 matrix into
    tile row ``tidx // tpr`` of ``sDst`` (16-byte ``cp.async``, interleaved over the row's ``tpr``
    threads; the caller commits/waits); a negative ``row_id`` writes zeros (masked column,
    finite V)."""
    tpr = threads // block_n
    r = tidx // tpr
    part = tidx % tpr
    dst_row = sDst[r, None]
    safe = cutlass.max(row_id, 0)
    row_base = cutlass.Int64(safe) * row_elems
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cpasync.LoadCacheMode.GLOBAL), BF16,
                               num_bits_per_copy=128)
    for j in cutlass.range_constexpr(width // 8 // tpr):
        c = part + j * tpr
        dst = cute.local_tile(dst_row, (8,), (c,))
        if row_id >= 0:
            src = cute.make_tensor((src_ptr + (row_base + c * 8)).align(16), cute.make_layout(8))
            cute.copy(atom, src, dst)
        else:
            dst.fill(0.0)


@cute.jit
def gather_rows_fp8(src_ptr: cute.Pointer, sDst: cute.Tensor, row_id: cutlass.Int32,
                    tidx: cutlass.Int32, block_n: cutlass.Constexpr,
                    threads: cutlass.Constexpr):
    """Dequantize row ``row_id`` of a ``[*, 656]`` uint8 FlashMLA FP8 cache into tile row
    ``tidx // tpr`` of ``sDst`` as 576 bf16 values (512 ``e4m3 * scale[d // 128]``, then the
    64 bf16 rope values copied); a negative ``row_id`` writes zeros."""
    tpr = threads // block_n
    r = tidx // tpr
    part = tidx % tpr
    dst_row = sDst[r, None]
    safe = cutlass.max(row_id, 0)
    row_base = cutlass.Int64(safe) * FP8_ROW_BYTES
    f8_ptr = cute.recast_ptr(src_ptr, dtype=cutlass.Float8E4M3FN)
    f32_ptr = cute.recast_ptr(src_ptr, dtype=cutlass.Float32)
    bf_ptr = cute.recast_ptr(src_ptr, dtype=BF16)
    for j in cutlass.range_constexpr(32 // tpr):
        c = part + j * tpr
        dst = cute.local_tile(dst_row, (16,), (c,))
        if row_id >= 0:
            src = cute.make_tensor((f8_ptr + (row_base + c * 16)).align(16), cute.make_layout(16))
            sc = cute.make_tensor(f32_ptr + ((row_base + FP8_SCALE_OFFSET) // 4 + c // 8),
                                  cute.make_layout(1))
            scale = sc[0]
            dst.store((src.load().to(cutlass.Float32) * scale).to(BF16))
        else:
            dst.fill(0.0)
    for j in cutlass.range_constexpr(8 // tpr):
        c = part + j * tpr
        dst = cute.local_tile(dst_row, (8,), (64 + c,))
        if row_id >= 0:
            src = cute.make_tensor((bf_ptr + ((row_base + FP8_ROPE_OFFSET) // 2 + c * 8)).align(16),
                                   cute.make_layout(8))
            dst.store(src.load())
        else:
            dst.fill(0.0)


@cute.jit
def stage_kv_tile(idx_ptr: cute.Pointer, tile_base: cutlass.Int32, tidx: cutlass.Int32,
                  sRow: cute.Tensor, k_ptr: cute.Pointer, k_row_elems: cutlass.Constexpr,
                  dqk: cutlass.Constexpr, sK: cute.Tensor, v_ptr: cute.Pointer,
                  v_row_elems: cutlass.Constexpr, d_v: cutlass.Constexpr, sV: cute.Tensor,
                  kv_fp8: cutlass.Constexpr, v_in_k: cutlass.Constexpr,
                  block_n: cutlass.Constexpr, threads: cutlass.Constexpr):
    """Stage one tile of ``block_n`` selected rows: their row ids into ``sRow`` (-1 = skipped),
    K (bf16, or FP8 dequantized) into ``sK`` and, unless V lives in K, V into ``sV``; then wait
    for the copies and make them visible to the async proxy and to every thread of the CTA."""
    row_id = load_row_id(idx_ptr, tile_base, tidx, block_n, threads)
    if tidx % (threads // block_n) == 0:
        sRow[tidx // (threads // block_n)] = row_id
    if cutlass.const_expr(kv_fp8):
        gather_rows_fp8(k_ptr, sK, row_id, tidx, block_n, threads)
    else:
        gather_rows_bf16(k_ptr, k_row_elems, dqk, sK, row_id, tidx, block_n, threads)
    if cutlass.const_expr(not v_in_k):
        gather_rows_bf16(v_ptr, v_row_elems, d_v, sV, row_id, tidx, block_n, threads)
    cute.arch.cp_async_commit_group()
    cute.arch.cp_async_wait_group(0)
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.sync_threads()


@cute.jit
def load_q_rows(q_ptr: cute.Pointer, tok_stride: cutlass.Int64, head_stride: cutlass.Int64,
                token: cutlass.Int32, head0: cutlass.Int32, rows_valid: cutlass.Int32,
                sQ: cute.Tensor, tidx: cutlass.Int32, m_rows: cutlass.Constexpr,
                d: cutlass.Constexpr, threads: cutlass.Constexpr):
    """Stage ``m_rows`` query heads (``head0 ..``; rows ``>= rows_valid`` zero) into ``sQ``."""
    chunks = m_rows * (d // 8)
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(), BF16, num_bits_per_copy=128)
    for j in cutlass.range_constexpr(chunks // threads):
        ch = tidx + j * threads
        r = ch // (d // 8)
        c = ch % (d // 8)
        dst = cute.local_tile(sQ[r, None], (8,), (c,))
        if r < rows_valid:
            off = cutlass.Int64(token) * tok_stride + cutlass.Int64(head0 + r) * head_stride
            src = cute.make_tensor((q_ptr + (off + c * 8)).align(16), cute.make_layout(8))
            cute.copy(atom, src, dst)
        else:
            dst.fill(0.0)
