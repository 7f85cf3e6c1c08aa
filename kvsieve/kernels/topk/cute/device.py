"""Device code of the CuTe-DSL GVR top-k (Guess-Verify-Refine, self-sampling), SM90/SM100.

One CTA (``THREADS`` = 512 threads, 16 warps) owns one row. Scores are read as raw int32 bits
and mapped to *signed* order keys (``skey``: larger float <=> larger int32, ``-0.0`` folded onto
``+0.0``; ``skey ^ 0x80000000`` is the unsigned key of ``naive.ordered_keys``), so every compare
is a plain signed int32 compare.

Per row of ``n`` entries:

* ``n <= K``: write ``0..n-1`` then ``-1``.
* **Guess.** ``SAMPLE`` = 1024 strided entries ``row[i * n // 1024]`` go to shared memory. Two
  radix selects (4 x 8-bit passes, shared-memory histogram with atomics) find the sample order
  statistics at ranks ``r +/- (3 sqrt(r) + 4)``, ``r = K * 1024 / n``: ``lo`` and ``hi``.
* **Verify.** One pass over the row, ``VEC`` = 4 consecutive entries per thread per chunk of
  2048: entries with ``key >= lo`` are counted in 256 bins (``(key - lo) >> sh``, ``sh`` the
  smallest shift that maps ``hi - lo`` below 256, top bin clamped; any monotone binning keeps
  the result exact) and compacted, **in position order** (warp shuffle scan + per-warp totals),
  into a shared-memory scratch of ``capacity`` (key, position) pairs.
* **Refine.** The crossing bin ``b`` (largest bin with ``count(bins >= b) >= K``) comes from a
  one-warp suffix scan of the histogram; a radix select among the scratch entries of bin ``b``
  gives the exact threshold key ``thr`` and how many entries equal to it to take (``need``).
* **Emit.** One ordered compaction over the scratch writes entries ``> thr`` and the first
  ``need`` entries ``== thr``: slot = (#greater before) + min(#equal before, need), so positions
  come out ascending and the lowest positions win the ties (the Triton kernels' rule).
* **Fallback (inside the kernel).** If the guess yields fewer than ``K`` or more than
  ``capacity`` candidates (e.g. all-equal rows), the radix select and the emission run over the
  whole row from global memory instead. The result is exact either way; ``stats[row] = 1``
  records it.

No ``from __future__ import annotations``: the DSL reads ``cutlass.Constexpr`` annotations at
trace time.
"""
import cutlass
import cutlass.cute as cute

from .params import BINS, CHUNK, SAMPLE, THREADS, VEC, WARPS, capacity_for, smem_bytes

I32 = cutlass.Int32
I64 = cutlass.Int64
F32 = cutlass.Float32
INT_MIN = -(2 ** 31)


@cute.jit
def skey(bits: I32) -> I32:
    """fp32 bits -> signed order key (``-0.0`` -> ``+0.0``)."""
    b = bits
    if b == INT_MIN:
        b = I32(0)
    if b < 0:
        b = b ^ I32(0x7FFFFFFF)
    return b


@cute.jit
def bin_of(key: I32, lo: I32, sh: I64) -> I32:
    d = (I64(key) - I64(lo)) >> sh
    if d > I64(BINS - 1):
        d = I64(BINS - 1)
    return I32(d)


@cute.jit
def block_excl_scan(v: I32, sWarp: cute.Tensor, parity: I32, tidx: I32):
    """Exclusive prefix sum of ``v`` over the CTA's threads in thread order, and the total.
    One barrier; ``sWarp`` is double-buffered by ``parity`` (alternate it per call)."""
    lane = tidx % 32
    warp = tidx // 32
    incl = v
    for o in cutlass.range_constexpr(5):
        t = cute.arch.shuffle_sync_up(incl, 1 << o)
        if lane >= (1 << o):
            incl = incl + t
    if lane == 31:
        sWarp[parity * WARPS + warp] = incl
    cute.arch.sync_threads()
    before = I32(0)
    total = I32(0)
    for w in cutlass.range_constexpr(WARPS):
        x = sWarp[parity * WARPS + w]
        if warp > w:
            before = before + x
        total = total + x
    return before + incl - v, total


@cute.jit
def find_crossing(sHist: cute.Tensor, need: I32, sBc: cute.Tensor, tidx: I32):
    """Warp 0: the largest bin ``d`` with ``count(bins >= d) >= need`` -> ``sBc[0]``, and
    ``need - count(bins > d)`` -> ``sBc[1]``. The caller syncs before and after."""
    if tidx < 32:
        lane = tidx
        s = I32(0)
        for j in cutlass.range_constexpr(8):
            s = s + sHist[lane * 8 + j]
        suf = s
        for o in cutlass.range_constexpr(5):
            t = cute.arch.shuffle_sync_down(suf, 1 << o)
            if lane + (1 << o) < 32:
                suf = suf + t
        run = suf - s  # entries in the bins of the lanes above
        for jj in cutlass.range_constexpr(8):
            j = 7 - jj
            c = sHist[lane * 8 + j]
            if run < need:
                if run + c >= need:
                    sBc[0] = lane * 8 + j
                    sBc[1] = need - run
            run = run + c


@cute.jit
def radix_select(src: cute.Tensor, count: I32, k_rem: I32, lo: I32, sh: I64, b_sel: I32,
                 sHist: cute.Tensor, sBc: cute.Tensor, tidx: I32,
                 from_row: cutlass.Constexpr, filtered: cutlass.Constexpr):
    """Signed key ``thr`` of the ``k_rem``-th largest member among the first ``count`` entries
    of ``src`` (row bits when ``from_row``, else keys), and how many members equal to ``thr``
    to take. Members: all entries, or with ``filtered`` those whose verify bin is ``b_sel``."""
    h = I32(0)  # (thr >> shift) of the digits chosen so far
    kr = k_rem
    for p in cutlass.range_constexpr(4):
        shift = 24 - 8 * p
        if tidx < BINS:
            sHist[tidx] = 0
        cute.arch.sync_threads()
        for i in cutlass.range(tidx, count, THREADS):
            key = src[i]
            if cutlass.const_expr(from_row):
                key = skey(key)
            m = I32(1)
            if cutlass.const_expr(filtered):
                if bin_of(key, lo, sh) != b_sel:
                    m = I32(0)
            if cutlass.const_expr(p > 0):
                if (key >> (shift + 8)) != h:
                    m = I32(0)
            if m != 0:
                d = (key >> shift) & 255
                if cutlass.const_expr(p == 0):
                    d = (key >> 24) + 128
                cute.arch.atomic_add(sHist.iterator + d, I32(1))
        cute.arch.sync_threads()
        find_crossing(sHist, kr, sBc, tidx)
        cute.arch.sync_threads()
        d_sel = sBc[0]
        kr = sBc[1]
        if cutlass.const_expr(p == 0):
            h = d_sel - 128
        else:
            h = h * 256 + d_sel
    return h, kr


@cute.jit
def emit(src: cute.Tensor, srcPos: cute.Tensor, count: I32, thr: I32, need: I32,
         gOut: cute.Tensor, k: cutlass.Constexpr, sWarp: cute.Tensor, tidx: I32,
         from_row: cutlass.Constexpr):
    """Ordered compaction of the first ``count`` entries: keys ``> thr`` and the first ``need``
    keys ``== thr`` go to ``gOut`` in position order; the rest of ``gOut[:k]`` gets -1."""
    gt_base = I32(0)
    eq_base = I32(0)
    parity = I32(0)
    keys = cute.make_rmem_tensor(cute.make_layout(VEC), I32)
    for c0 in cutlass.range(0, count, CHUNK):
        base = c0 + tidx * VEC
        packed = I32(0)  # (#greater) | (#equal << 16) among this thread's entries
        for j in cutlass.range_constexpr(VEC):
            key = I32(INT_MIN)
            if base + j < count:
                key = src[base + j]
                if cutlass.const_expr(from_row):
                    key = skey(key)
            keys[j] = key
            if base + j < count:
                if key > thr:
                    packed = packed + 1
                if key == thr:
                    packed = packed + 65536
        excl, total = block_excl_scan(packed, sWarp, parity, tidx)
        gt = gt_base + (excl & 65535)
        eq = eq_base + (excl >> 16)
        for j in cutlass.range_constexpr(VEC):
            if base + j < count:
                key = keys[j]
                pos = base + j
                if cutlass.const_expr(not from_row):
                    pos = srcPos[base + j]
                if key > thr:
                    gOut[gt + cutlass.min(eq, need)] = pos
                    gt = gt + 1
                if key == thr:
                    if eq < need:
                        gOut[gt + eq] = pos
                    eq = eq + 1
        gt_base = gt_base + (total & 65535)
        eq_base = eq_base + (total >> 16)
        parity = parity ^ 1
    taken = gt_base + cutlass.min(eq_base, need)
    for i in cutlass.range(taken + tidx, k, THREADS):
        gOut[i] = -1


class GvrTopK:
    """One compiled variant per ``k`` (512, 1024 or 2048)."""

    threads = THREADS

    def __init__(self, k: int):
        self.k = k
        self.capacity = capacity_for(k)
        self.smem_size = smem_bytes(k)

    @cute.jit
    def __call__(self, s_ptr: cute.Pointer, len_ptr: cute.Pointer, out_ptr: cute.Pointer,
                 stats_ptr: cute.Pointer, rows: I32, width: I32, stride_s: I64, stride_o: I64,
                 has_stats: I32, stream):
        self.kernel(s_ptr, len_ptr, out_ptr, stats_ptr, width, stride_s, stride_o,
                    has_stats).launch(
            grid=(rows, 1, 1), block=(THREADS, 1, 1), smem=self.smem_size, stream=stream)

    @cute.kernel
    def kernel(self, s_ptr: cute.Pointer, len_ptr: cute.Pointer, out_ptr: cute.Pointer,
               stats_ptr: cute.Pointer, width: I32, stride_s: I64, stride_o: I64,
               has_stats: I32):
        K, C = self.k, self.capacity
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()

        smem = cutlass.utils.SmemAllocator()
        sCK = smem.allocate_tensor(I32, cute.make_layout(C), 16)
        sCP = smem.allocate_tensor(I32, cute.make_layout(C), 16)
        sSamp = smem.allocate_tensor(I32, cute.make_layout(SAMPLE), 16)
        sHist = smem.allocate_tensor(I32, cute.make_layout(BINS), 16)
        sWarp = smem.allocate_tensor(I32, cute.make_layout(2 * WARPS), 16)
        sBc = smem.allocate_tensor(I32, cute.make_layout(8), 16)

        gLen = cute.make_tensor(len_ptr, cute.make_layout(1 << 30))
        gRow = cute.make_tensor(s_ptr + I64(row) * stride_s, cute.make_layout(1 << 30))
        gOut = cute.make_tensor(out_ptr + I64(row) * stride_o, cute.make_layout(K))
        n = cutlass.min(gLen[row], width)  # never read past the row, whatever the length
        fallback = I32(0)
        if n <= K:
            for i in cutlass.range(tidx, K, THREADS):
                v = i
                if i >= n:
                    v = I32(-1)
                gOut[i] = v
        else:
            # ---- guess: strided sample, two sample order statistics
            for i in cutlass.range(tidx, SAMPLE, THREADS):
                sSamp[i] = skey(gRow[I32((I64(i) * I64(n)) // SAMPLE)])
            rk = F32(K * SAMPLE) / F32(n)
            margin = F32(3.0) * cute.math.sqrt(rk) + F32(4.0)
            x_lo = rk + margin
            r_lo = I32(x_lo)
            if F32(r_lo) < x_lo:
                r_lo = r_lo + 1
            r_lo = cutlass.min(r_lo, SAMPLE - 1)
            r_hi = cutlass.max(I32(rk - margin), 0)
            zero_sh = I64(0)
            lo, _ = radix_select(sSamp, I32(SAMPLE), r_lo + 1, I32(0), zero_sh, I32(0), sHist,
                                 sBc, tidx, False, False)
            hi, _ = radix_select(sSamp, I32(SAMPLE), r_hi + 1, I32(0), zero_sh, I32(0), sHist,
                                 sBc, tidx, False, False)
            diff = I64(hi) - I64(lo)
            sh = I64(0)
            for s in cutlass.range_constexpr(25):
                if (diff >> s) >= BINS:
                    sh = I64(s + 1)

            # ---- verify: one pass, bin counts + ordered compaction of key >= lo
            if tidx < BINS:
                sHist[tidx] = 0
            cute.arch.sync_threads()
            cnt = I32(0)
            parity = I32(0)
            keys = cute.make_rmem_tensor(cute.make_layout(VEC), I32)
            for c0 in cutlass.range(0, n, CHUNK):
                base = c0 + tidx * VEC
                c = I32(0)
                for j in cutlass.range_constexpr(VEC):
                    key = I32(INT_MIN)
                    if base + j < n:
                        key = skey(gRow[base + j])
                        if key >= lo:
                            c = c + 1
                            cute.arch.atomic_add(sHist.iterator + bin_of(key, lo, sh), I32(1))
                    keys[j] = key
                excl, total = block_excl_scan(c, sWarp, parity, tidx)
                slot = cnt + excl
                for j in cutlass.range_constexpr(VEC):
                    if base + j < n:
                        if keys[j] >= lo:
                            if slot < C:
                                sCK[slot] = keys[j]
                                sCP[slot] = base + j
                            slot = slot + 1
                cnt = cnt + total
                parity = parity ^ 1
            cute.arch.sync_threads()

            ok = I32(0)
            if cnt >= K:
                if cnt <= C:
                    ok = I32(1)
            if ok != 0:
                # ---- refine inside the crossing bin, emit from the scratch
                find_crossing(sHist, I32(K), sBc, tidx)
                cute.arch.sync_threads()
                b_sel = sBc[0]
                k_in_bin = sBc[1]
                thr, need = radix_select(sCK, cnt, k_in_bin, lo, sh, b_sel, sHist, sBc, tidx,
                                         False, True)
                emit(sCK, sCP, cnt, thr, need, gOut, K, sWarp, tidx, False)
            else:
                # ---- exact fallback over the whole row
                fallback = I32(1)
                thr, need = radix_select(gRow, n, I32(K), I32(0), zero_sh, I32(0), sHist, sBc,
                                         tidx, True, False)
                emit(gRow, gRow, n, thr, need, gOut, K, sWarp, tidx, True)
        if has_stats != 0:
            if tidx == 0:
                gStats = cute.make_tensor(stats_ptr, cute.make_layout(1 << 30))
                gStats[row] = fallback
