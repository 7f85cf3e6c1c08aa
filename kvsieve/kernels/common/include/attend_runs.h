/* Attention of one decode token's KV head over runs of a paged cache (online softmax, fp32), shared
 * by the native CPU kernels that attend (sparse_gqa_decode.c, decode_layer.c); included, not compiled
 * alone. Built with -O3 -march=native -fopenmp-simd -fno-math-errno: the loops marked `omp simd` are
 * vectorized, nothing else is reassociated. */
#ifndef KVSIEVE_ATTEND_RUNS_H
#define KVSIEVE_ATTEND_RUNS_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec_math.h"

#define ATTEND_CHUNK 64 /* tokens scored before their softmax update */
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
  float acc[KV_MAX_G][KV_MAX_D], m[KV_MAX_G], l[KV_MAX_G], s[KV_MAX_G][ATTEND_CHUNK], row[KV_MAX_D];
  int64_t v_off_of[ATTEND_CHUNK];
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
    int n = 0; /* gather up to ATTEND_CHUNK tokens' scores */
    while (u < n_runs && n < ATTEND_CHUNK) {
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
        take = cnt[u] - t < ATTEND_CHUNK - n ? cnt[u] - t : ATTEND_CHUNK - n;
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

#endif
