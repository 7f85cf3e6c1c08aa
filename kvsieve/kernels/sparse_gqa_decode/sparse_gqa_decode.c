/* Attention of decode tokens over runs of their KV cache, on the CPU (the op's contract:
 * sparse_decode/__init__.py).
 *
 * Per KV head h, a token's G query heads attend the first cnt tokens of each of its runs: in
 * kvsieve_sparse_decode (one token) K rows at row k_rows[h][u] of the pool viewed as rows of unit * D,
 * V rows v_offset rows further; in kvsieve_sparse_decode_runs (many tokens) runs given by element
 * offsets, K stored by rows or by channel (vLLM's CPU layout), V by rows. Online softmax over the runs
 * in order (fp32), reading the cache in place (bf16 or fp32; no gather).
 * Built with -O3 -march=native -fopenmp -fno-math-errno -ffp-contract=fast: the loops marked `omp simd` are
 * vectorized, a product added to a sum is one fused multiply-add, nothing else is reassociated. */
#include <stdint.h>
#include <stdlib.h>

#include "attend_runs.h"

/* k_rows, cnt [hkv, n_runs]: run u of head h is rows k_rows[h][u] (K) and k_rows[h][u] + v_offset (V)
 * of the pool viewed as rows of unit * D; q [hkv, G, D] fp32; out [hkv, G, D] fp32; lse [hkv, G] fp32.
 * Returns 0, -1 for shapes past KV_MAX_D/KV_MAX_G, -2 when out of memory. */
int kvsieve_sparse_decode(const void* pool, int is_bf16, const int64_t* k_rows, const int32_t* cnt, int hkv,
                          int64_t n_runs, int64_t v_offset, int unit, int D, const float* q, int G, float sm_scale,
                          float* out, float* lse) {
  if (D > KV_MAX_D || G > KV_MAX_G || D < 1 || G < 1 || unit < 1) return -1;
  int64_t* off = (int64_t*)malloc(sizeof(int64_t) * 2 * (n_runs > 0 ? n_runs : 1));
  if (off == NULL) return -2;
  const int64_t row_len = (int64_t)unit * D;
  for (int h = 0; h < hkv; ++h) {
    const int64_t* kr = k_rows + (int64_t)h * n_runs;
    for (int64_t u = 0; u < n_runs; ++u) {
      off[u] = kr[u] * row_len;
      off[n_runs + u] = (kr[u] + v_offset) * row_len;
    }
    attend_dispatch(pool, pool, is_bf16, off, off + n_runs, cnt + (int64_t)h * n_runs, n_runs, 0, 0, NULL, D,
                    q + (int64_t)h * G * D, G, sm_scale, out + (int64_t)h * G * D, lse + (int64_t)h * G);
  }
  free(off);
  return 0;
}

/* Many decode rows over runs given by element offsets (the contract: sparse_decode/__init__.py,
 * sparse_decode_runs). The runs of (row n, KV head h) are [ptr[h * n_rows + n], ptr[h * n_rows + n + 1]):
 * K of token t of run r at k_off[r] + t * D of k (k_ch = 0: rows of D) or channel d at
 * k_off[r] + t + d * k_ch (k_ch > 0: K stored by channel); its V row at v_off[r] + t * D of v.
 * q [n_rows, hkv, G, D] fp32; out [n_rows, hkv, G, D] fp32; lse [n_rows, hkv, G] fp32.
 * Returns 0, or -1 for shapes past KV_MAX_D/KV_MAX_G. */
int kvsieve_sparse_decode_runs(const void* k, const void* v, int is_bf16, int64_t k_ch, const int64_t* ptr,
                               const int64_t* k_off, const int64_t* v_off, const int32_t* cnt, int64_t n_rows,
                               int hkv, int D, const float* q, int G, float sm_scale, float* out, float* lse) {
  if (D > KV_MAX_D || G > KV_MAX_G || D < 1 || G < 1 || k_ch < 0) return -1;
  for (int64_t n = 0; n < n_rows; ++n) {
    for (int h = 0; h < hkv; ++h) {
      const int64_t a = ptr[h * n_rows + n], b = ptr[h * n_rows + n + 1];
      const int64_t qo = (n * hkv + h) * G;
      attend_dispatch(k, v, is_bf16, k_off + a, v_off + a, cnt + a, b - a, k_ch > 0, k_ch, NULL, D, q + qo * D, G,
                      sm_scale, out + qo * D, lse + qo);
    }
  }
  return 0;
}

/* The runs of a selection (the contract: runs.py, selection_runs). idx: row-major with row stride
 * idx_stride (KV head h's entries at idx + h * idx_stride), row n's segment [offsets[n], offsets[n+1]);
 * each entry a unit of units_of positions cut into pieces of unit = gcd(units_of, block_size); table
 * [n_rows, table_width] with row stride table_stride. Writes ptr [hkv * n_rows + 1], per run block,
 * head, start (int64) and cnt (int32), at most max_runs of them, and attended [n_rows, hkv].
 * Returns the number of runs, -1 when more than max_runs, -2 for a position past its table row. */
int64_t kvsieve_selection_runs(const int32_t* idx, int64_t idx_stride, const int64_t* offsets, int64_t n_rows, int hkv,
                               int units_of, int unit, const int32_t* table, int64_t table_stride, int64_t table_width,
                               const int32_t* kv_lens, int block_size, int64_t max_runs, int64_t* ptr, int64_t* block,
                               int64_t* head, int64_t* start, int32_t* cnt, int64_t* attended) {
  const int per = units_of / unit;
  int64_t r = 0;
  ptr[0] = 0;
  for (int h = 0; h < hkv; ++h) {
    const int32_t* ih = idx + (int64_t)h * idx_stride;
    for (int64_t n = 0; n < n_rows; ++n) {
      const int64_t len = kv_lens[n];
      int64_t run_end = -1, run_blk = -1, total = 0; /* the open run's next position and block */
      for (int64_t e = offsets[n]; e < offsets[n + 1]; ++e) {
        if (ih[e] < 0) break; /* padding: the segment's tail */
        for (int j = 0; j < per; ++j) {
          const int64_t pos = ((int64_t)ih[e] * per + j) * unit;
          if (pos >= len) break;
          const int64_t c = len - pos < unit ? len - pos : unit, blk = pos / block_size;
          total += c;
          if (pos == run_end && blk == run_blk) { /* extends the open run */
            cnt[r - 1] += (int32_t)c;
            run_end += c;
            continue;
          }
          if (blk >= table_width) return -2;
          if (r >= max_runs) return -1;
          block[r] = table[n * table_stride + blk];
          head[r] = h;
          start[r] = pos % block_size;
          cnt[r] = (int32_t)c;
          ++r;
          run_end = pos + c;
          run_blk = blk;
        }
      }
      ptr[(int64_t)h * n_rows + n + 1] = r;
      attended[n * hkv + h] = total;
    }
  }
  return r;
}
