/* Page top-k of one decode token, on the CPU (the op's contract: page_topk/__init__.py).
 *
 * Per KV head h: the page scores of the token's G query heads against each page's (min, max) row
 * of the summary pool, softmax over the pages per query head, mean over the group, the newest page
 * forced to 2.0, then the k best pages (ties to the lower page) in ascending page order.
 * The pool is read where it lies (bf16 or fp32; no gather, no upcast copy); the math is fp32.
 * Built with -O3 -march=native -fopenmp-simd -fno-math-errno: the loops marked `omp simd` are
 * vectorized, nothing else is reassociated. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

#define MAX_D 256
#define MAX_G 16

enum { MODE_BOUND = 0, MODE_SIGN = 1 };

/* Order-preserving key of (score, page): larger score first, then the lower page. */
static inline uint64_t rank_key(float s, int64_t page) {
  union { float f; int32_t i; } x = {.f = s + 0.0f}; /* -0.0 as +0.0 */
  int32_t b = x.i < 0 ? x.i ^ 0x7FFFFFFF : x.i;
  uint64_t hi = (uint64_t)((int64_t)b + 0x80000000LL);
  return (hi << 32) | (0xFFFFFFFFull - (uint64_t)page);
}

/* The k-th largest of a[0..n) (keys distinct), reordering a. */
static uint64_t kth_largest(uint64_t* a, int64_t n, int64_t k) {
  int64_t lo = 0, hi = n - 1, want = k - 1;
  while (lo < hi) {
    uint64_t pivot = a[lo + (hi - lo) / 2];
    int64_t i = lo, j = hi;
    while (i <= j) {
      while (a[i] > pivot) ++i;
      while (a[j] < pivot) --j;
      if (i <= j) { uint64_t t = a[i]; a[i] = a[j]; a[j] = t; ++i; --j; }
    }
    if (want <= j) hi = j;
    else if (want >= i) lo = i;
    else return a[want];
  }
  return a[want];
}

/* logits[g * n_pages + p] = sm_scale * qcat[g] . row(p) for KV head h; D is a constant at the
 * call sites that matter, so the row loops unroll. */
static inline __attribute__((always_inline)) void head_logits(
    const void* pool, int is_bf16, const int64_t* block_ids, int64_t n_pages, int hkv, int sub, int D, int h,
    float qcat[MAX_G][2 * MAX_D], int G, float sm_scale, float* logits) {
  float row[2 * MAX_D];
  int64_t p = 0;
  for (int64_t b = 0; p < n_pages; ++b) {
    for (int s = 0; s < sub && p < n_pages; ++s, ++p) {
      int64_t off = ((block_ids[b] * hkv + h) * sub + s) * 2 * D;
      if (is_bf16) {
        const uint16_t* src = (const uint16_t*)pool + off;
#pragma omp simd
        for (int d = 0; d < 2 * D; ++d) row[d] = bf16_to_f32(src[d]);
      } else {
        memcpy(row, (const float*)pool + off, sizeof(float) * 2 * D);
      }
      for (int g = 0; g < G; ++g) {
        const float* qg = qcat[g];
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int d = 0; d < 2 * D; ++d) acc += qg[d] * row[d];
        logits[g * n_pages + p] = acc * sm_scale;
      }
    }
  }
}

/* One token's pages (the op's contract): scores [hkv, n_pages]; sel: head h's k pages at sel + h * sel_stride;
 * logits [G * n_pages] and keys [n_pages] are scratch. */
static void topk_row(const void* pool, int is_bf16, const int64_t* block_ids, int64_t n_pages, int hkv, int sub, int D,
                     const float* q, int G, float sm_scale, int mode, int64_t k, float* scores, int32_t* sel,
                     int64_t sel_stride, float* logits, uint64_t* keys) {
  float qcat[MAX_G][2 * MAX_D];
  for (int h = 0; h < hkv; ++h) {
    const float* qh = q + (int64_t)h * G * D;
    for (int d = 0; d < D; ++d) {  /* (min, max) partners: bound = (min(q,0), max(q,0)); sign = by group sum */
      float group = 0.0f;
      for (int g = 0; g < G; ++g) group += qh[g * D + d];
      for (int g = 0; g < G; ++g) {
        float v = qh[g * D + d];
        int use_max = mode == MODE_SIGN ? group > 0.0f : 0;
        qcat[g][d] = mode == MODE_SIGN ? (use_max ? 0.0f : v) : (v < 0.0f ? v : 0.0f);
        qcat[g][D + d] = mode == MODE_SIGN ? (use_max ? v : 0.0f) : (v > 0.0f ? v : 0.0f);
      }
    }
    if (D == 64) head_logits(pool, is_bf16, block_ids, n_pages, hkv, sub, 64, h, qcat, G, sm_scale, logits);
    else if (D == 128) head_logits(pool, is_bf16, block_ids, n_pages, hkv, sub, 128, h, qcat, G, sm_scale, logits);
    else head_logits(pool, is_bf16, block_ids, n_pages, hkv, sub, D, h, qcat, G, sm_scale, logits);

    float* sh = scores + (int64_t)h * n_pages;
    for (int64_t p = 0; p < n_pages; ++p) sh[p] = 0.0f;
    for (int g = 0; g < G; ++g) {  /* softmax over the pages, summed over the group */
      float* l = logits + (int64_t)g * n_pages;
      float m = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : m)
      for (int64_t p = 0; p < n_pages; ++p) m = l[p] > m ? l[p] : m;
#pragma omp simd reduction(+ : sum)
      for (int64_t p = 0; p < n_pages; ++p) { l[p] = exp_nonpositive(l[p] - m); sum += l[p]; }
      float inv = 1.0f / sum;
#pragma omp simd
      for (int64_t p = 0; p < n_pages; ++p) sh[p] += l[p] * inv;
    }
#pragma omp simd
    for (int64_t p = 0; p < n_pages; ++p) sh[p] /= (float)G;
    sh[n_pages - 1] = 2.0f;  /* the newest page (scores are <= 1) */

    for (int64_t p = 0; p < n_pages; ++p) keys[p] = rank_key(sh[p], p);
    uint64_t kth = kth_largest(keys, n_pages, k);
    int32_t* out = sel + (int64_t)h * sel_stride;
    int64_t n = 0;
    for (int64_t p = 0; p < n_pages && n < k; ++p)
      if (rank_key(sh[p], p) >= kth) out[n++] = (int32_t)p;
  }
}

/* pool: rows of 2*D (min, max) at ((block * hkv + h) * sub + s) * 2*D, bf16 (is_bf16) or fp32;
 * block_ids [ceil(n_pages / sub)]; q [hkv, G, D] fp32; scores out [hkv, n_pages]; sel out [hkv, k].
 * Returns 0, or -1 for shapes past MAX_D/MAX_G or k outside [1, n_pages], -2 when out of memory. */
int kvsieve_page_topk(const void* pool, int is_bf16, const int64_t* block_ids, int64_t n_pages, int hkv, int sub,
                      int D, const float* q, int G, float sm_scale, int mode, int64_t k, float* scores, int32_t* sel) {
  if (D > MAX_D || G > MAX_G || D < 1 || G < 1 || k < 1 || k > n_pages) return -1;
  float* logits = malloc(sizeof(float) * (size_t)G * (size_t)n_pages);
  uint64_t* keys = malloc(sizeof(uint64_t) * (size_t)n_pages);
  if (!logits || !keys) { free(logits); free(keys); return -2; }
  topk_row(pool, is_bf16, block_ids, n_pages, hkv, sub, D, q, G, sm_scale, mode, k, scores, sel, k, logits, keys);
  free(logits);
  free(keys);
  return 0;
}

/* Many decode tokens in one call: token n has n_pages[n] pages in blocks table[n * width ...] and keeps
 * ks[n] per head; q [n_rows, hkv, G, D] fp32; sel out [hkv, sum(ks)]: token n's pages of head h from
 * column ks[0] + ... + ks[n-1] of row h. Returns as kvsieve_page_topk. */
int kvsieve_page_topk_rows(const void* pool, int is_bf16, const int64_t* table, int64_t width, const int64_t* n_pages,
                           const int64_t* ks, int64_t n_rows, int hkv, int sub, int D, const float* q, int G,
                           float sm_scale, int mode, int32_t* sel) {
  if (D > MAX_D || G > MAX_G || D < 1 || G < 1) return -1;
  int64_t most = 1, total = 0;
  for (int64_t n = 0; n < n_rows; ++n) {
    if (ks[n] < 1 || ks[n] > n_pages[n] || n_pages[n] > width * sub) return -1;
    most = n_pages[n] > most ? n_pages[n] : most;
    total += ks[n];
  }
  float* logits = malloc(sizeof(float) * (size_t)(G + hkv) * (size_t)most);
  uint64_t* keys = malloc(sizeof(uint64_t) * (size_t)most);
  if (!logits || !keys) { free(logits); free(keys); return -2; }
  int64_t col = 0;
  for (int64_t n = 0; n < n_rows; ++n) {  /* scores: scratch after the logits */
    topk_row(pool, is_bf16, table + n * width, n_pages[n], hkv, sub, D, q + n * hkv * G * D, G, sm_scale, mode, ks[n],
             logits + (int64_t)G * most, sel + col, total, logits, keys);
    col += ks[n];
  }
  free(logits);
  free(keys);
  return 0;
}
