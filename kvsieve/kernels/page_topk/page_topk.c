/* Page top-k of one decode token, on the CPU (the op's contract: page_topk/__init__.py).
 *
 * Per KV head h: the page scores of the token's G query heads against each page's (min, max) row
 * of the summary pool, softmax over the pages per query head, mean over the group, the newest page
 * forced to 2.0, then the k best pages (ties to the lower page) in ascending page order.
 * The pool is read where it lies (bf16 or fp32; no gather, no upcast copy); the math is fp32.
 * Built with -O3 -march=native -fopenmp -fno-math-errno -ffp-contract=fast: the loops marked `omp simd` are
 * vectorized, a product added to a sum is one fused multiply-add, nothing else is reassociated. */
#include <stdint.h>
#include <stdlib.h>

#include "page_rank.h"

/* pool: rows of 2*D (min, max) at ((block * hkv + h) * sub + s) * 2*D, bf16 (is_bf16) or fp32;
 * block_ids [ceil(n_pages / sub)]; q [hkv, G, D] fp32; scores out [hkv, n_pages]; sel out [hkv, k].
 * Returns 0, or -1 for shapes past KV_MAX_D/KV_MAX_G or k outside [1, n_pages], -2 when out of memory. */
int kvsieve_page_topk(const void* pool, int is_bf16, const int64_t* block_ids, int64_t n_pages, int hkv, int sub,
                      int D, const float* q, int G, float sm_scale, int mode, int64_t k, float* scores, int32_t* sel) {
  if (D > KV_MAX_D || G > KV_MAX_G || D < 1 || G < 1 || k < 1 || k > n_pages) return -1;
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
  if (D > KV_MAX_D || G > KV_MAX_G || D < 1 || G < 1) return -1;
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
