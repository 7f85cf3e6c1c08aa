/* Attention of decode tokens over runs of their KV cache, on the CPU (the op's contract:
 * sparse_decode/__init__.py).
 *
 * Per KV head h, a token's G query heads attend the first cnt tokens of each of its runs: in
 * kvsieve_sparse_decode (one token) K rows at row k_rows[h][u] of the pool viewed as rows of unit * D,
 * V rows v_offset rows further; in kvsieve_sparse_decode_runs (many tokens) runs given by element
 * offsets, K stored by rows or by channel (vLLM's CPU layout), V by rows. Online softmax over the runs
 * in order (fp32), reading the cache in place (bf16 or fp32; no gather).
 * Built with -O3 -march=native -fopenmp-simd -fno-math-errno: the loops marked `omp simd` are
 * vectorized, nothing else is reassociated. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

#define MAX_D 256
#define MAX_G 16
#define CHUNK 64 /* tokens scored before their softmax update */
#define PREFETCH_RUNS 8 /* how many runs ahead the rows are requested */

/* n consecutive elements as fp32: a row of D channels, or n tokens of one K channel stored by channel. */
static inline void load_row(const void* pool, int is_bf16, int64_t off, int n, float* dst) {
  if (is_bf16) {
    const uint16_t* src = (const uint16_t*)pool + off;
#pragma omp simd
    for (int j = 0; j < n; ++j) dst[j] = bf16_to_f32(src[j]);
  } else {
    memcpy(dst, (const float*)pool + off, sizeof(float) * n);
  }
}

static inline void prefetch_span(const char* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}

/* Ask for the K and V of a later run (its valid tokens) while this one is computed: a decode step
 * reads each run once, cold, so without this every run waits on memory. K by rows (k_ch = 0): n_tok
 * rows of D from k_off; by channel: D spans of n_tok tokens, k_ch apart. V: n_tok rows of D. */
static inline void prefetch_run(const void* kpool, const void* vpool, int is_bf16, int64_t k_off, int64_t v_off,
                                int n_tok, int64_t k_ch, int D) {
  const int es = is_bf16 ? 2 : 4;
  if (n_tok <= 0) return;
  const char* k = (const char*)kpool + k_off * es;
  if (k_ch == 0) prefetch_span(k, (int64_t)n_tok * D * es);
  else for (int d = 0; d < D; ++d) prefetch_span(k + (int64_t)d * k_ch * es, (int64_t)n_tok * es);
  prefetch_span((const char*)vpool + v_off * es, (int64_t)n_tok * D * es);
}

/* One KV head: online softmax over its runs. Run u: cnt[u] tokens; token t's K at k_off[u] + t*D of
 * kpool (K_COLS = 0: rows of D, channels contiguous) or channel d at k_off[u] + t + d*k_ch (K_COLS = 1:
 * K stored by channel, vLLM's CPU layout); its V row at v_off[u] + t*D of vpool. D, G and K_COLS are
 * constants at the call sites that matter. */
static inline __attribute__((always_inline)) void head_attend(
    const void* kpool, const void* vpool, int is_bf16, const int64_t* k_off, const int64_t* v_off, const int32_t* cnt,
    int64_t n_runs, int K_COLS, int64_t k_ch, int D, const float* qh, int G, float sm_scale, float* out, float* lse) {
  float acc[MAX_G][MAX_D], m[MAX_G], l[MAX_G], s[MAX_G][CHUNK], row[MAX_D];
  int64_t v_off_of[CHUNK];
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
    for (int d = 0; d < D; ++d) acc[g][d] = 0.0f;
  }
  const int64_t pf_ch = K_COLS ? k_ch : 0;
  for (int64_t r = 0; r < PREFETCH_RUNS && r < n_runs; ++r)
    prefetch_run(kpool, vpool, is_bf16, k_off[r], v_off[r], cnt[r], pf_ch, D);
  int64_t u = 0;
  int t = 0;
  while (u < n_runs) {
    int n = 0; /* gather up to CHUNK tokens' scores */
    while (u < n_runs && n < CHUNK) {
      if (t >= cnt[u]) { ++u; t = 0; continue; }
      if (t == 0 && u + PREFETCH_RUNS < n_runs)
        prefetch_run(kpool, vpool, is_bf16, k_off[u + PREFETCH_RUNS], v_off[u + PREFETCH_RUNS],
                     cnt[u + PREFETCH_RUNS], pf_ch, D);
      int take = 1;
      if (!K_COLS) {
        load_row(kpool, is_bf16, k_off[u] + (int64_t)t * D, D, row);
        for (int g = 0; g < G; ++g) {
          const float* qg = qh + g * D;
          float a = 0.0f;
#pragma omp simd reduction(+ : a)
          for (int d = 0; d < D; ++d) a += qg[d] * row[d];
          s[g][n] = a * sm_scale;
        }
      } else { /* the run's next tokens at once, channel by channel */
        take = cnt[u] - t < CHUNK - n ? cnt[u] - t : CHUNK - n;
        for (int g = 0; g < G; ++g)
          for (int j = 0; j < take; ++j) s[g][n + j] = 0.0f;
        for (int d = 0; d < D; ++d) {
          load_row(kpool, is_bf16, k_off[u] + t + (int64_t)d * k_ch, take, row);
          for (int g = 0; g < G; ++g) {
            float qd = qh[g * D + d], *sg = s[g] + n;
#pragma omp simd
            for (int j = 0; j < take; ++j) sg[j] += qd * row[j];
          }
        }
        for (int g = 0; g < G; ++g)
          for (int j = 0; j < take; ++j) s[g][n + j] *= sm_scale;
      }
      for (int j = 0; j < take; ++j) v_off_of[n + j] = v_off[u] + (int64_t)(t + j) * D;
      n += take;
      t += take;
    }
    if (n == 0) break;
    for (int g = 0; g < G; ++g) { /* rescale by the new running max */
      float mx = m[g];
      for (int j = 0; j < n; ++j) mx = s[g][j] > mx ? s[g][j] : mx;
      float corr = exp_nonpositive(m[g] - mx); /* m = -inf at first: 0 (clamped, times 0 state) */
      if (m[g] == -INFINITY) corr = 0.0f;
      l[g] *= corr;
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[g][d] *= corr;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < n; ++j) { s[g][j] = exp_nonpositive(s[g][j] - mx); sum += s[g][j]; }
      l[g] += sum;
      m[g] = mx;
    }
    for (int j = 0; j < n; ++j) {
      load_row(vpool, is_bf16, v_off_of[j], D, row);
      for (int g = 0; g < G; ++g) {
        float p = s[g][j];
#pragma omp simd
        for (int d = 0; d < D; ++d) acc[g][d] += p * row[d];
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    if (l[g] == 0.0f) { /* attends nothing: out 0, lse +inf */
      for (int d = 0; d < D; ++d) out[g * D + d] = 0.0f;
      lse[g] = INFINITY;
      continue;
    }
    float inv = 1.0f / l[g];
#pragma omp simd
    for (int d = 0; d < D; ++d) out[g * D + d] = acc[g][d] * inv;
    lse[g] = m[g] + logf(l[g]);
  }
}

/* One head's runs with D (and G, K_COLS) made constants for the common shapes. */
static void attend_dispatch(const void* kpool, const void* vpool, int is_bf16, const int64_t* ko, const int64_t* vo,
                            const int32_t* c, int64_t n_runs, int k_cols, int64_t k_ch, int D, const float* qh, int G,
                            float sm_scale, float* oh, float* lh) {
#define ATTEND(KC, DD, GG) head_attend(kpool, vpool, is_bf16, ko, vo, c, n_runs, KC, k_ch, DD, qh, GG, sm_scale, oh, lh)
  if (!k_cols) {
    if (D == 64 && G == 3) ATTEND(0, 64, 3);
    else if (D == 64 && G == 4) ATTEND(0, 64, 4);
    else if (D == 64) ATTEND(0, 64, G);
    else if (D == 128) ATTEND(0, 128, G);
    else ATTEND(0, D, G);
  } else {
    if (D == 64 && G == 3) ATTEND(1, 64, 3);
    else if (D == 64) ATTEND(1, 64, G);
    else if (D == 128) ATTEND(1, 128, G);
    else ATTEND(1, D, G);
  }
#undef ATTEND
}

/* k_rows, cnt [hkv, n_runs]: run u of head h is rows k_rows[h][u] (K) and k_rows[h][u] + v_offset (V)
 * of the pool viewed as rows of unit * D; q [hkv, G, D] fp32; out [hkv, G, D] fp32; lse [hkv, G] fp32.
 * Returns 0, -1 for shapes past MAX_D/MAX_G, -2 when out of memory. */
int kvsieve_sparse_decode(const void* pool, int is_bf16, const int64_t* k_rows, const int32_t* cnt, int hkv,
                          int64_t n_runs, int64_t v_offset, int unit, int D, const float* q, int G, float sm_scale,
                          float* out, float* lse) {
  if (D > MAX_D || G > MAX_G || D < 1 || G < 1 || unit < 1) return -1;
  int64_t* off = (int64_t*)malloc(sizeof(int64_t) * 2 * (n_runs > 0 ? n_runs : 1));
  if (off == NULL) return -2;
  const int64_t row_len = (int64_t)unit * D;
  for (int h = 0; h < hkv; ++h) {
    const int64_t* kr = k_rows + (int64_t)h * n_runs;
    for (int64_t u = 0; u < n_runs; ++u) {
      off[u] = kr[u] * row_len;
      off[n_runs + u] = (kr[u] + v_offset) * row_len;
    }
    attend_dispatch(pool, pool, is_bf16, off, off + n_runs, cnt + (int64_t)h * n_runs, n_runs, 0, 0, D,
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
 * Returns 0, or -1 for shapes past MAX_D/MAX_G. */
int kvsieve_sparse_decode_runs(const void* k, const void* v, int is_bf16, int64_t k_ch, const int64_t* ptr,
                               const int64_t* k_off, const int64_t* v_off, const int32_t* cnt, int64_t n_rows,
                               int hkv, int D, const float* q, int G, float sm_scale, float* out, float* lse) {
  if (D > MAX_D || G > MAX_G || D < 1 || G < 1 || k_ch < 0) return -1;
  for (int64_t n = 0; n < n_rows; ++n) {
    for (int h = 0; h < hkv; ++h) {
      const int64_t a = ptr[h * n_rows + n], b = ptr[h * n_rows + n + 1];
      const int64_t qo = (n * hkv + h) * G;
      attend_dispatch(k, v, is_bf16, k_off + a, v_off + a, cnt + a, b - a, k_ch > 0, k_ch, D, q + qo * D, G,
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
