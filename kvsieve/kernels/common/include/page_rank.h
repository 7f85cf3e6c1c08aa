/* Page scores and the k best pages of one decode token (Quest's bound or RocketKV's sign scores,
 * softmax over pages, mean over the KV group, newest page forced), shared by page_topk.c and
 * decode_layer.c; included, not compiled alone. */
#ifndef KVSIEVE_PAGE_RANK_H
#define KVSIEVE_PAGE_RANK_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec_math.h"


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

#define RADIX_BITS 11 /* a narrowing pass's digit: 2,048 counts, 8 KB */
#define RADIX_MIN 256 /* keys left to quickselect among */

/* The k-th largest of the n keys rank_key(score[i], i), 0 < k <= n: every key computed once into
 * keys (a vector loop), then passes of a radix select from the top digit (every key left counted by
 * its digit, the k-th's digit found from the top, the keys of that digit kept, branch-free) until at
 * most RADIX_MIN keys remain, then kth_largest among them. Where quickselect over all n mispredicts
 * about every other comparison. keys: scratch of n. */
static uint64_t kth_largest_score(const float* score, int64_t n, int64_t k, uint64_t* keys) {
  uint32_t count[1 << RADIX_BITS];
  const uint64_t mask = (1u << RADIX_BITS) - 1;
  int64_t m = n;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) keys[i] = rank_key(score[i], i);
  for (int shift = 64 - RADIX_BITS; m > RADIX_MIN && shift >= 0; shift -= RADIX_BITS) {
    memset(count, 0, sizeof(count));
    for (int64_t i = 0; i < m; ++i) ++count[(keys[i] >> shift) & mask];
    int64_t above = 0, digit = (int64_t)mask;
    while (above + count[digit] < k) above += count[digit--]; /* the k-th key's digit */
    const uint64_t want = (uint64_t)digit;
    int64_t kept = 0;
    for (int64_t i = 0; i < m; ++i) {
      const uint64_t key = keys[i];
      keys[kept] = key;
      kept += ((key >> shift) & mask) == want;
    }
    m = kept;
    k -= above;
  }
  return kth_largest(keys, m, k);
}

#define SELECT_CHUNK 64 /* positions whose comparisons one vector loop makes before they are written */

/* The k best of score[0..n) (ties to the lower index) written ascending to out (room for k + 1);
 * returns k. */
static int64_t top_ascending(const float* score, int64_t n, int64_t k, uint64_t* keys, int32_t* out) {
  if (k >= n) {
    for (int64_t i = 0; i < n; ++i) out[i] = (int32_t)i;
    return n;
  }
  const uint64_t kth = kth_largest_score(score, n, k, keys);
  int64_t m = 0; /* exactly k keys are >= the k-th (keys are distinct) */
  for (int64_t i0 = 0; i0 < n; i0 += SELECT_CHUNK) {
    const int64_t i1 = n - i0 < SELECT_CHUNK ? n : i0 + SELECT_CHUNK;
    uint8_t hit[SELECT_CHUNK];
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) hit[i - i0] = rank_key(score[i], i) >= kth;
    for (int64_t i = i0; i < i1; ++i) {
      out[m] = (int32_t)i;
      m += hit[i - i0];
    }
  }
  return m;
}

/* logits[g * n_pages + p] = sm_scale * qcat[g] . row(p) for KV head h: each page's row (fp32 in row)
 * read once for three heads at a time, their dot products 8 lanes wide in two named sums each (six
 * chains of fused multiply-adds in flight); D is a constant at the call sites that matter. */
static inline __attribute__((always_inline)) void head_logits(
    const void* pool, int is_bf16, const int64_t* block_ids, int64_t n_pages, int hkv, int sub, int D, int h,
    float qcat[KV_MAX_G][2 * KV_MAX_D], int G, float sm_scale, float* logits) {
  float row[2 * KV_MAX_D];
  int64_t p = 0;
  const int es = is_bf16 ? 2 : 4;
  for (int64_t b = 0; p < n_pages; ++b) {
    if (p + sub < n_pages) { /* the next block's rows requested while this one's are scored */
      const char* next = (const char*)pool + ((block_ids[b + 1] * hkv + h) * sub) * 2 * D * es;
      for (int64_t o = 0; o < (int64_t)sub * 2 * D * es; o += 64) __builtin_prefetch(next + o, 0, 2);
    }
    for (int s = 0; s < sub && p < n_pages; ++s, ++p) {
      int64_t off = ((block_ids[b] * hkv + h) * sub + s) * 2 * D;
      if (is_bf16) {
        const uint16_t* src = (const uint16_t*)pool + off;
#pragma omp simd
        for (int d = 0; d < 2 * D; ++d) row[d] = bf16_to_f32(src[d]);
      } else {
        memcpy(row, (const float*)pool + off, sizeof(float) * 2 * D);
      }
      int g = 0;
      for (; g + 3 <= G; g += 3) {
        const float *q0 = qcat[g], *q1 = qcat[g + 1], *q2 = qcat[g + 2];
        vm_f32x8 a0 = {0}, a1 = {0}, b0 = {0}, b1 = {0}, c0 = {0}, c1 = {0}, x, y, w;
        for (int d = 0; d < 2 * D; d += 16) {
          memcpy(&x, row + d, sizeof(x));
          memcpy(&y, row + d + 8, sizeof(y));
          memcpy(&w, q0 + d, sizeof(w));
          a0 += w * x;
          memcpy(&w, q0 + d + 8, sizeof(w));
          a1 += w * y;
          memcpy(&w, q1 + d, sizeof(w));
          b0 += w * x;
          memcpy(&w, q1 + d + 8, sizeof(w));
          b1 += w * y;
          memcpy(&w, q2 + d, sizeof(w));
          c0 += w * x;
          memcpy(&w, q2 + d + 8, sizeof(w));
          c1 += w * y;
        }
        logits[g * n_pages + p] = lane_sum(a0 + a1) * sm_scale;
        logits[(g + 1) * n_pages + p] = lane_sum(b0 + b1) * sm_scale;
        logits[(g + 2) * n_pages + p] = lane_sum(c0 + c1) * sm_scale;
      }
      for (; g < G; ++g) { /* the heads past the last three */
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
  float qcat[KV_MAX_G][2 * KV_MAX_D];
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

#endif
