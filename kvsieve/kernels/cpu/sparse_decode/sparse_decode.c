/* Attention of one decode token over runs of its KV cache, on the CPU (the op's contract:
 * sparse_decode/__init__.py).
 *
 * Per KV head h, the token's G query heads attend the first cnt[h][u] tokens of each run u: K rows
 * at row k_rows[h][u] of the pool viewed as rows of unit * D, V rows v_offset rows further. Online
 * softmax over the runs in order (fp32), reading the pool in place (bf16 or fp32; no gather).
 * Built with -O3 -march=native -fopenmp-simd -fno-math-errno: the loops marked `omp simd` are
 * vectorized, nothing else is reassociated. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec_math.h"

#define MAX_D 256
#define MAX_G 16
#define CHUNK 64 /* tokens scored before their softmax update */
#define PREFETCH_RUNS 8 /* how many runs ahead the rows are requested */

static inline void load_row(const void* pool, int is_bf16, int64_t off, int D, float* dst) {
  if (is_bf16) {
    const uint16_t* src = (const uint16_t*)pool + off;
#pragma omp simd
    for (int d = 0; d < D; ++d) dst[d] = bf16_to_f32(src[d]);
  } else {
    memcpy(dst, (const float*)pool + off, sizeof(float) * D);
  }
}

/* Ask for the K and V rows of a later run (its valid tokens) while this one is computed: a decode
 * step reads each run once, cold, so without this every run waits on memory. */
static inline void prefetch_run(const void* pool, int is_bf16, int64_t k_off, int64_t v_delta, int n_tok, int D) {
  const char* k = (const char*)pool + k_off * (is_bf16 ? 2 : 4);
  const char* v = k + v_delta * (is_bf16 ? 2 : 4);
  int64_t bytes = (int64_t)n_tok * D * (is_bf16 ? 2 : 4);
  for (int64_t b = 0; b < bytes; b += 64) { __builtin_prefetch(k + b); __builtin_prefetch(v + b); }
}

/* One KV head: online softmax over its runs. D (and G) are constants at the call sites that matter. */
static inline __attribute__((always_inline)) void head_attend(
    const void* pool, int is_bf16, const int64_t* k_rows, const int32_t* cnt, int64_t n_runs, int64_t v_offset,
    int unit, int D, const float* qh, int G, float sm_scale, float* out, float* lse) {
  float acc[MAX_G][MAX_D], m[MAX_G], l[MAX_G], s[MAX_G][CHUNK], row[MAX_D];
  int64_t v_off_of[CHUNK];
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
    for (int d = 0; d < D; ++d) acc[g][d] = 0.0f;
  }
  const int64_t row_len = (int64_t)unit * D;
  for (int64_t r = 0; r < PREFETCH_RUNS && r < n_runs; ++r)
    prefetch_run(pool, is_bf16, k_rows[r] * row_len, v_offset * row_len, cnt[r], D);
  int64_t u = 0;
  int t = 0;
  while (u < n_runs) {
    int n = 0; /* gather up to CHUNK tokens' scores */
    while (u < n_runs && n < CHUNK) {
      if (t >= cnt[u]) { ++u; t = 0; continue; }
      if (t == 0 && u + PREFETCH_RUNS < n_runs) prefetch_run(pool, is_bf16, k_rows[u + PREFETCH_RUNS] * row_len,
                                                             v_offset * row_len, cnt[u + PREFETCH_RUNS], D);
      int64_t k_off = k_rows[u] * row_len + (int64_t)t * D;
      load_row(pool, is_bf16, k_off, D, row);
      for (int g = 0; g < G; ++g) {
        const float* qg = qh + g * D;
        float a = 0.0f;
#pragma omp simd reduction(+ : a)
        for (int d = 0; d < D; ++d) a += qg[d] * row[d];
        s[g][n] = a * sm_scale;
      }
      v_off_of[n] = k_off + v_offset * row_len;
      ++n;
      ++t;
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
      load_row(pool, is_bf16, v_off_of[j], D, row);
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

/* k_rows, cnt [hkv, n_runs]; q [hkv, G, D] fp32; out [hkv, G, D] fp32; lse [hkv, G] fp32.
 * Returns 0, or -1 for shapes past MAX_D/MAX_G. */
int kvsieve_sparse_decode(const void* pool, int is_bf16, const int64_t* k_rows, const int32_t* cnt, int hkv,
                          int64_t n_runs, int64_t v_offset, int unit, int D, const float* q, int G, float sm_scale,
                          float* out, float* lse) {
  if (D > MAX_D || G > MAX_G || D < 1 || G < 1 || unit < 1) return -1;
  for (int h = 0; h < hkv; ++h) {
    const int64_t* kr = k_rows + (int64_t)h * n_runs;
    const int32_t* c = cnt + (int64_t)h * n_runs;
    const float* qh = q + (int64_t)h * G * D;
    float* oh = out + (int64_t)h * G * D;
    float* lh = lse + (int64_t)h * G;
#define ATTEND(DD, GG) head_attend(pool, is_bf16, kr, c, n_runs, v_offset, unit, DD, qh, GG, sm_scale, oh, lh)
    if (D == 64 && G == 3) ATTEND(64, 3);
    else if (D == 64 && G == 4) ATTEND(64, 4);
    else if (D == 64) ATTEND(64, G);
    else if (D == 128) ATTEND(128, G);
    else ATTEND(D, G);
#undef ATTEND
  }
  return 0;
}
