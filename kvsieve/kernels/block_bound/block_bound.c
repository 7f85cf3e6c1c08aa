/* block_select's selection by Quest's bound for many query rows in one call, on the CPU (the contract:
 * native.py). Per row and KV head: every block before the row's own scored from the request's block
 * summaries, the own block from the row's own summary (its positions up to the row), the group's
 * largest bound times sm_scale; the first init and the last local visible blocks forced; the k best
 * (ties to the lower block) written ascending by the radix select of page_rank.h (top_ascending).
 * The summaries come channel-major ([2D, units] per request and head), so sixteen blocks' bounds are
 * one vector of sums: per channel one load of the summaries and one fused multiply-add per query head,
 * no horizontal sum, no [rows x blocks] scores beyond a row's. Rows spread over OpenMP threads.
 * Built with -O3 -march=native -fopenmp -fno-math-errno -ffp-contract=fast. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "page_rank.h"

#define UNIT_TILE 32 /* blocks scored together: two vectors of 16 */
typedef float bb_f32x16 __attribute__((vector_size(64)));

typedef struct {
  const float* bounds; /* [B, hkv, 2D, units] */
  int64_t units;       /* a multiple of UNIT_TILE */
  const float* own;    /* [n, hkv, 2D] */
  const float* q;      /* [n, hkv * G, D] */
  const int32_t* req;
  const int32_t* lens;
  int hkv, G, D;
  int64_t block_size, k, init_units, local_units;
  float sm_scale;
} BoundArgs;

/* score[u] = max over g of qc[g] . bt[:, u] for u < n (bt: [2D, units] channel-major): UNIT_TILE blocks
 * at a time as two vectors per query head, so 2 * G chains of fused multiply-adds are in flight (one
 * chain would wait on its own latency); G is a constant at the call (tile_bounds) for the usual groups. */
static inline __attribute__((always_inline)) void tile_bounds_g(const float* bt, int64_t units, const float* qc,
                                                                const int G, int d2, int64_t n, float* score) {
  for (int64_t u0 = 0; u0 < n; u0 += UNIT_TILE) {
    bb_f32x16 acc0[KV_MAX_G], acc1[KV_MAX_G], x0, x1;
    for (int g = 0; g < G; ++g) acc0[g] = acc1[g] = (bb_f32x16){0};
    for (int d = 0; d < d2; ++d) {
      memcpy(&x0, bt + (int64_t)d * units + u0, sizeof(x0));
      memcpy(&x1, bt + (int64_t)d * units + u0 + 16, sizeof(x1));
      for (int g = 0; g < G; ++g) {
        const float w = qc[(int64_t)g * d2 + d];
        acc0[g] += w * x0;
        acc1[g] += w * x1;
      }
    }
    float best[UNIT_TILE];
    for (int j = 0; j < 16; ++j) {
      float b0 = acc0[0][j], b1 = acc1[0][j];
      for (int g = 1; g < G; ++g) {
        b0 = acc0[g][j] > b0 ? acc0[g][j] : b0;
        b1 = acc1[g][j] > b1 ? acc1[g][j] : b1;
      }
      best[j] = b0;
      best[16 + j] = b1;
    }
    const int64_t m = n - u0 < UNIT_TILE ? n - u0 : UNIT_TILE;
    memcpy(score + u0, best, sizeof(float) * (size_t)m);
  }
}

static void tile_bounds(const float* bt, int64_t units, const float* qc, int G, int d2, int64_t n, float* score) {
#define G_CASE(GG) \
  case GG:         \
    tile_bounds_g(bt, units, qc, GG, d2, n, score); \
    return;
  switch (G) {
    G_CASE(1)
    G_CASE(2)
    G_CASE(3)
    G_CASE(4)
    G_CASE(6)
    G_CASE(8)
    default:
      tile_bounds_g(bt, units, qc, G, d2, n, score);
  }
#undef G_CASE
}

/* Row r's selection into sel [hkv, k]. qc: scratch [G, 2D]; score, keys: scratch of units; top: k + 1. */
static void select_row(const BoundArgs* a, int64_t r, float* qc, float* score, uint64_t* keys, int32_t* top,
                       int32_t* sel) {
  const int G = a->G, D = a->D, d2 = 2 * D;
  const int64_t len = a->lens[r], n_valid = (len + a->block_size - 1) / a->block_size, own_blk = n_valid - 1;
  const int64_t k = a->k < n_valid ? a->k : n_valid;
  for (int h = 0; h < a->hkv; ++h) {
    int32_t* dst = sel + (int64_t)h * a->k;
    for (int64_t i = k; i < a->k; ++i) dst[i] = -1;
    if (n_valid <= a->k) { /* every visible block */
      for (int64_t i = 0; i < n_valid; ++i) dst[i] = (int32_t)i;
      continue;
    }
    for (int g = 0; g < G; ++g) { /* [min(q, 0), max(q, 0)]: its product with (min, max) is the bound */
      const float* qg = a->q + (r * a->hkv * G + (int64_t)h * G + g) * D;
      for (int d = 0; d < D; ++d) {
        qc[g * d2 + d] = qg[d] < 0.0f ? qg[d] : 0.0f;
        qc[g * d2 + D + d] = qg[d] > 0.0f ? qg[d] : 0.0f;
      }
    }
    tile_bounds(a->bounds + ((int64_t)a->req[r] * a->hkv + h) * d2 * a->units, a->units, qc, G, d2, own_blk, score);
    const float* own = a->own + (r * a->hkv + h) * d2;
    float best = 0.0f;
    for (int g = 0; g < G; ++g) {
      float acc = 0.0f;
      for (int d = 0; d < d2; ++d) acc += qc[g * d2 + d] * own[d];
      best = g == 0 || acc > best ? acc : best;
    }
    score[own_blk] = best;
    for (int64_t u = 0; u < n_valid; ++u)
      score[u] = u < a->init_units || u >= n_valid - a->local_units ? INFINITY : score[u] * a->sm_scale;
    const int64_t m = top_ascending(score, n_valid, k, keys, top);
    memcpy(dst, top, sizeof(int32_t) * (size_t)m);
  }
}

/* bounds [B, hkv, 2D, units] fp32 (units a multiple of 32; per request, head and channel the blocks'
 * min then max keys, channel-major), own [n, hkv, 2D] fp32, q [n, hkv * G, D] fp32, req [n] and lens
 * [n] int32 (row n's request, its visible positions, >= 1); sel [n, hkv, k] int32: the k best blocks
 * ascending (every visible block when there are no more than k), -1 after. Returns 0, -1 for shapes
 * past the kernel's (D > KV_MAX_D, G > KV_MAX_G, a row past its request's units), -2 when out of memory. */
int kvsieve_block_bound_topk(const float* bounds, int64_t units, const float* own, const float* q, const int32_t* req,
                             const int32_t* lens, int64_t n_rows, int hkv, int G, int D, int64_t block_size,
                             int64_t k, int64_t init_units, int64_t local_units, float sm_scale, int32_t* sel) {
  if (D < 1 || D > KV_MAX_D || G < 1 || G > KV_MAX_G || hkv < 1 || k < 1 || block_size < 1 || units % UNIT_TILE)
    return -1;
  for (int64_t r = 0; r < n_rows; ++r)
    if (lens[r] < 1 || (lens[r] + block_size - 1) / block_size > units) return -1;
  const BoundArgs a = {bounds, units, own, q, req, lens, hkv, G, D, block_size, k, init_units, local_units, sm_scale};
  int rc = 0;
#pragma omp parallel
  {
    float* qc = (float*)malloc(sizeof(float) * (size_t)G * 2 * D);
    float* score = (float*)malloc(sizeof(float) * (size_t)units);
    uint64_t* keys = (uint64_t*)malloc(sizeof(uint64_t) * (size_t)units);
    int32_t* top = (int32_t*)malloc(sizeof(int32_t) * (size_t)(k + 1));
    if (qc == NULL || score == NULL || keys == NULL || top == NULL) {
#pragma omp atomic write
      rc = -2;
    }
#pragma omp barrier
    int ok;
#pragma omp atomic read
    ok = rc;
    if (ok == 0) { /* every thread takes the loop, or none does */
#pragma omp for schedule(dynamic, 32)
      for (int64_t r = 0; r < n_rows; ++r) select_row(&a, r, qc, score, keys, top, sel + r * hkv * k);
    }
    free(qc);
    free(score);
    free(keys);
    free(top);
  }
  return rc;
}
