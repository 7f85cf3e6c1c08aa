/* Attention of a prompt's query rows over runs of a paged cache, on the CPU (the contract:
 * native.py). Same runs and result as kvsieve_sparse_decode_runs (sparse_gqa_decode.c), another loop
 * order: a decode row reads each of its blocks once, cold; a prompt's neighbouring rows select mostly
 * the same blocks, so the rows are taken in tiles of TILE_ROWS per KV head and each tile visits its
 * runs block by block: a block's K (and later its V) is loaded once from memory and every row of the
 * tile that selected in it reads it from the L1/L2. Per tile: the logits of every selected token, the
 * softmax per (row, query head), then the weighted V rows, block by block again. Tiles x KV heads are
 * spread over OpenMP threads.
 * Built with -O3 -march=native -fopenmp -fno-math-errno -ffp-contract=fast: the loops marked `omp simd`
 * are vectorized, a product added to a sum is one fused multiply-add, nothing else is reassociated. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec_math.h"

#define TILE_ROWS 32 /* query rows sharing a pass over their blocks */

static inline float load1(const void* pool, int is_bf16, int64_t off) {
  return is_bf16 ? bf16_to_f32(((const uint16_t*)pool)[off]) : ((const float*)pool)[off];
}

/* The next block the tile visits: that of the first row with runs left (-1: none left). Every row
 * takes its runs in ascending position, so rows sharing a block meet there. */
static int64_t next_block(const int64_t* cur, const int64_t* end, int R, const int64_t* blk) {
  for (int r = 0; r < R; ++r)
    if (cur[r] < end[r]) return blk[cur[r]];
  return -1;
}

/* Logits of n <= LANES tokens for G query heads: s[j][g] = sum over d, in order, of qh[g][d] * K_j[d],
 * token j's channel d at offs[j] + d * ch (K by channel: vLLM's CPU layout; ch = 1: rows). The tokens
 * go side by side (one fused multiply-add per head and channel for all of them), so no sum waits on
 * the one before; G and the dtype are constants at the call (tokens_logits), so the sums stay in
 * registers. */
#define LANES 8
typedef float f32x8 __attribute__((vector_size(32)));
static inline __attribute__((always_inline)) void lanes_logits(const void* k, const int BF16, const int64_t* offs,
                                                               int n, int64_t ch, int D, const float* qh, const int G,
                                                               float* s) {
  f32x8 acc[KV_MAX_G];
  for (int g = 0; g < G; ++g) acc[g] = (f32x8){0};
  int64_t o[LANES];
  for (int j = 0; j < LANES; ++j) o[j] = offs[j < n ? j : 0];
  for (int d = 0; d < D; ++d) {
    f32x8 x;
    const int64_t dd = (int64_t)d * ch;
    for (int j = 0; j < LANES; ++j) x[j] = load1(k, BF16, o[j] + dd);
    for (int g = 0; g < G; ++g) acc[g] += qh[g * D + d] * x;
  }
  for (int j = 0; j < n; ++j)
    for (int g = 0; g < G; ++g) s[j * G + g] = acc[g][j];
}

static void tokens_logits(const void* k, int is_bf16, const int64_t* offs, int n, int64_t ch, int D, const float* qh,
                          int G, float* s) {
#define LANES_CASE(GG)                                                         \
  case GG:                                                                     \
    if (is_bf16) lanes_logits(k, 1, offs, n, ch, D, qh, GG, s);                \
    else lanes_logits(k, 0, offs, n, ch, D, qh, GG, s);                        \
    return;
  switch (G) {
    LANES_CASE(1)
    LANES_CASE(2)
    LANES_CASE(3)
    LANES_CASE(4)
    LANES_CASE(6)
    LANES_CASE(8)
    default:
      if (is_bf16) lanes_logits(k, 1, offs, n, ch, D, qh, G, s);
      else lanes_logits(k, 0, offs, n, ch, D, qh, G, s);
  }
#undef LANES_CASE
}

/* One (tile, KV head): rows n0..n0+R-1 of head h. Returns 0, -2 when out of memory. */
static int tile_attend(const void* k, const void* v, int is_bf16, int64_t k_ch, const int64_t* ptr,
                       const int64_t* blk, const int64_t* k_off, const int64_t* v_off, const int32_t* cnt,
                       int64_t n_rows, int hkv, int D, const float* q, int G, float sm_scale, float* out, float* lse,
                       int64_t n0, int R, int h) {
  int64_t cur[TILE_ROWS], end[TILE_ROWS], base[TILE_ROWS], fill[TILE_ROWS], total = 0;
  for (int r = 0; r < R; ++r) {
    cur[r] = ptr[h * n_rows + n0 + r];
    end[r] = ptr[h * n_rows + n0 + r + 1];
    base[r] = total;
    for (int64_t u = cur[r]; u < end[r]; ++u) total += cnt[u];
  }
  float* s = (float*)malloc(sizeof(float) * (size_t)(total > 0 ? total : 1) * G); /* [token][g] per row */
  float* acc = (float*)calloc((size_t)R * G * D, sizeof(float));
  float vrow[KV_MAX_D];
  if (s == NULL || acc == NULL) {
    free(s);
    free(acc);
    return -2;
  }
  const int64_t ch = k_ch > 0 ? k_ch : 1, tok = k_ch > 0 ? 1 : D;
  /* pass 1: the logits, block by block, LANES tokens of a row at a time */
  int64_t offs[LANES];
  for (int r = 0; r < R; ++r) fill[r] = 0;
  for (int64_t b = next_block(cur, end, R, blk); b >= 0; b = next_block(cur, end, R, blk)) {
    for (int r = 0; r < R; ++r) {
      const float* qh = q + ((n0 + r) * hkv + h) * (int64_t)G * D;
      int n = 0;
      for (; cur[r] < end[r] && blk[cur[r]] == b; ++cur[r]) {
        const int64_t u = cur[r];
        for (int t = 0; t < cnt[u]; ++t) {
          offs[n++] = k_off[u] + t * tok;
          if (n == LANES) {
            tokens_logits(k, is_bf16, offs, n, ch, D, qh, G, s + (base[r] + fill[r]) * G);
            fill[r] += n;
            n = 0;
          }
        }
      }
      if (n > 0) {
        tokens_logits(k, is_bf16, offs, n, ch, D, qh, G, s + (base[r] + fill[r]) * G);
        fill[r] += n;
      }
    }
  }
  /* the softmax of each (row, query head): s becomes the weights, unnormalized */
  float m[TILE_ROWS][KV_MAX_G], l[TILE_ROWS][KV_MAX_G];
  for (int r = 0; r < R; ++r) {
    float* sr = s + base[r] * G;
    for (int g = 0; g < G; ++g) {
      float mx = -INFINITY, sum = 0.0f;
      for (int64_t j = 0; j < fill[r]; ++j) mx = fmaxf(mx, sr[j * G + g] * sm_scale);
      for (int64_t j = 0; j < fill[r]; ++j) {
        const float p = exp_nonpositive(sr[j * G + g] * sm_scale - mx);
        sr[j * G + g] = p;
        sum += p;
      }
      m[r][g] = mx;
      l[r][g] = sum;
    }
  }
  /* pass 2: the weighted V rows, block by block */
  for (int r = 0; r < R; ++r) {
    cur[r] = ptr[h * n_rows + n0 + r];
    fill[r] = 0;
  }
  for (int64_t b = next_block(cur, end, R, blk); b >= 0; b = next_block(cur, end, R, blk)) {
    for (int r = 0; r < R; ++r) {
      float* ar = acc + (int64_t)r * G * D;
      for (; cur[r] < end[r] && blk[cur[r]] == b; ++cur[r]) {
        const int64_t u = cur[r];
        for (int t = 0; t < cnt[u]; ++t, ++fill[r]) {
          const int64_t vo = v_off[u] + (int64_t)t * D;
          if (is_bf16) {
            const uint16_t* src = (const uint16_t*)v + vo;
#pragma omp simd
            for (int d = 0; d < D; ++d) vrow[d] = bf16_to_f32(src[d]);
          } else {
            const float* src = (const float*)v + vo;
#pragma omp simd
            for (int d = 0; d < D; ++d) vrow[d] = src[d];
          }
          const float* p = s + (base[r] + fill[r]) * G;
          for (int g = 0; g < G; ++g) {
            const float pg = p[g];
            float* a = ar + g * D;
#pragma omp simd
            for (int d = 0; d < D; ++d) a[d] += pg * vrow[d];
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t o = ((n0 + r) * hkv + h) * (int64_t)G;
    for (int g = 0; g < G; ++g) {
      const float* a = acc + ((int64_t)r * G + g) * D;
      float* dst = out + (o + g) * D;
      const float inv = l[r][g] > 0.0f ? 1.0f / l[r][g] : 0.0f;
      for (int d = 0; d < D; ++d) dst[d] = a[d] * inv;
      lse[o + g] = l[r][g] > 0.0f ? m[r][g] + logf(l[r][g]) : INFINITY;
    }
  }
  free(s);
  free(acc);
  return 0;
}

/* The runs of (row n, KV head h) are [ptr[h * n_rows + n], ptr[h * n_rows + n + 1]), ascending in
 * position; run u lies in cache block blk[u] (any id, the same for every run of that block); K of its
 * token t at k_off[u] + t * D of k (k_ch = 0: rows of D) or channel d at k_off[u] + t + d * k_ch (k_ch >
 * 0: K stored by channel), its V row at v_off[u] + t * D of v. q [n_rows, hkv, G, D] fp32; out
 * [n_rows, hkv, G, D] fp32; lse [n_rows, hkv, G] fp32 (natural log of the sum of exp(sm_scale * logit);
 * a (row, head) without tokens: out 0, lse +inf). Returns 0, -1 for shapes past KV_MAX_D/KV_MAX_G, -2
 * when out of memory. */
int kvsieve_prompt_runs(const void* k, const void* v, int is_bf16, int64_t k_ch, const int64_t* ptr,
                        const int64_t* blk, const int64_t* k_off, const int64_t* v_off, const int32_t* cnt,
                        int64_t n_rows, int hkv, int D, const float* q, int G, float sm_scale, float* out,
                        float* lse) {
  if (D > KV_MAX_D || G > KV_MAX_G || D < 1 || G < 1 || k_ch < 0) return -1;
  const int64_t tiles = (n_rows + TILE_ROWS - 1) / TILE_ROWS;
  int rc = 0;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t task = 0; task < tiles * hkv; ++task) {
    const int64_t n0 = (task / hkv) * TILE_ROWS;
    const int R = (int)(n_rows - n0 < TILE_ROWS ? n_rows - n0 : TILE_ROWS);
    if (tile_attend(k, v, is_bf16, k_ch, ptr, blk, k_off, v_off, cnt, n_rows, hkv, D, q, G, sm_scale, out, lse, n0,
                    R, (int)(task % hkv)) != 0) {
#pragma omp atomic write
      rc = -2;
    }
  }
  return rc;
}
