/* The DSA indexer's projections of a step's few tokens on the CPU (the op's contract:
 * indexer_project/__init__.py): one pass over the stacked weight, then the key's LayerNorm, the
 * neox RoPE and the weights' scale, in place in the outputs.
 * Built with -O3 -march=native -fopenmp -fno-math-errno -ffp-contract=fast. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

#define MAX_TOKENS 64
#define CHUNK 32 /* the outputs one task computes (two vectors): a chunk of the packed weight */

typedef float f32x16 __attribute__((vector_size(64)));

/* y[t][j] = sum over c of x[t][c] * wc[c][j], j < CHUNK (wc [K, CHUNK]: one chunk of the packed weight),
 * for tn tokens (a constant at each call, so the 2 * tn running sums stay in registers); one running sum
 * per output, in channel order */
static inline __attribute__((always_inline)) void chunk_gemv(const float* wc, const float* x, int K, int tn,
                                                           float y[][CHUNK]) {
  f32x16 acc[8][2];
  for (int t = 0; t < tn; ++t) acc[t][0] = acc[t][1] = (f32x16){0};
  for (int c = 0; c < K; ++c) {
    f32x16 w0, w1;
    memcpy(&w0, wc + (int64_t)c * CHUNK, sizeof(w0));
    memcpy(&w1, wc + (int64_t)c * CHUNK + 16, sizeof(w1));
    for (int t = 0; t < tn; ++t) {
      float xv = x[(int64_t)t * K + c];
      acc[t][0] += xv * w0;
      acc[t][1] += xv * w1;
    }
  }
  for (int t = 0; t < tn; ++t) memcpy(y[t], acc[t], sizeof(acc[t]));
}

/* rotate the first r channels of v by halves: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s) */
static inline void neox(float* v, const float* c, const float* s, int r) {
  int half = r / 2;
  for (int i = 0; i < half; ++i) {
    float x1 = v[i], x2 = v[i + half];
    v[i] = x1 * c[i] - x2 * s[i];
    v[i + half] = x2 * c[i] + x1 * s[i];
  }
}

static inline void layer_norm(float* v, const float* w, const float* b, float eps, int d) {
  float mean = 0.0f, var = 0.0f;
  for (int i = 0; i < d; ++i) mean += v[i];
  mean /= (float)d;
  for (int i = 0; i < d; ++i) var += (v[i] - mean) * (v[i] - mean);
  float rstd = 1.0f / sqrtf(var / (float)d + eps);
  for (int i = 0; i < d; ++i) v[i] = (v[i] - mean) * rstd * w[i] + b[i];
}

/* hidden: token t's channel c at hidden[t * h_stride + c] (fp32, or bf16 when hidden_bf16); wt [chunks, K,
 * CHUNK] fp32, the stacked weight (rows wq, weights_proj, wk) packed: its row n, channel c at
 * wt[n / CHUNK][c][n % CHUNK], the entries past its last row zero; ln_w/ln_b [D] or both NULL; cos/sin [T, R] (NULL when R == 0);
 * q [T, H, D], k [T, D], w [T, H] fp32 contiguous, written; q_bf16: q rounded to bf16's precision last
 * (nearest-even, as torch rounds), for a bf16 key pool. threads <= 0: OpenMP's default.
 * Returns 0; 1 for a shape outside what the kernel takes (nothing written); 2 out of memory. */
int kvsieve_indexer_project(const void* hidden, int hidden_bf16, int64_t h_stride, int T, int K, const float* wt,
                            int chunks, const float* ln_w, const float* ln_b, float eps, const float* cos,
                            const float* sin, int H, int D, int R, float w_scale, float* q, float* k, float* w,
                            int q_bf16, int threads) {
  const int64_t HD = (int64_t)H * D, N = HD + H + D;
  if (T < 0 || T > MAX_TOKENS || K < 1 || H < 1 || D < 1 || R < 0 || R > D || R % 2 || (R && (!cos || !sin))
      || (!ln_w) != (!ln_b) || (int64_t)chunks * CHUNK < N)
    return 1;
  if (T == 0) return 0;
  float* x = malloc(sizeof(float) * (size_t)T * (size_t)K);
  if (!x) return 2;
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < K; ++c)
      x[(int64_t)t * K + c] = hidden_bf16 ? bf16_to_f32(((const uint16_t*)hidden)[t * h_stride + c])
                                          : ((const float*)hidden)[t * h_stride + c];
  int nt = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel num_threads(nt)
  {
#pragma omp for schedule(static)
    for (int ch = 0; ch < chunks; ++ch) {
      const float* wc = wt + (int64_t)ch * K * CHUNK;
      for (int t0 = 0; t0 < T;) {
        float y[8][CHUNK];
        const float* xt = x + (int64_t)t0 * K;
        int tn = T - t0 >= 8 ? 8 : T - t0 >= 4 ? 4 : T - t0 >= 2 ? 2 : 1;
        switch (tn) {
          case 8: chunk_gemv(wc, xt, K, 8, y); break;
          case 4: chunk_gemv(wc, xt, K, 4, y); break;
          case 2: chunk_gemv(wc, xt, K, 2, y); break;
          default: chunk_gemv(wc, xt, K, 1, y);
        }
        for (int t = 0; t < tn; ++t)
          for (int j = 0; j < CHUNK; ++j) {
            int64_t n = (int64_t)ch * CHUNK + j, tt = t0 + t;
            if (n < HD) q[tt * HD + n] = y[t][j];
            else if (n < HD + H) w[tt * H + (n - HD)] = y[t][j] * w_scale;
            else if (n < N) k[tt * D + (n - HD - H)] = y[t][j];
          }
        t0 += tn;
      }
    }
#pragma omp for schedule(static)
    for (int t = 0; t < T; ++t) {
      float* kt = k + (int64_t)t * D;
      if (ln_w) layer_norm(kt, ln_w, ln_b, eps, D);
      if (R) {
        const float *c = cos + (int64_t)t * R, *s = sin + (int64_t)t * R;
        neox(kt, c, s, R);
        for (int h = 0; h < H; ++h) neox(q + (int64_t)t * HD + (int64_t)h * D, c, s, R);
      }
      if (q_bf16)
        for (int64_t i = t * HD; i < (t + 1) * HD; ++i) q[i] = bf16_to_f32(f32_to_bf16(q[i]));
    }
  }
  free(x);
  return 0;
}
