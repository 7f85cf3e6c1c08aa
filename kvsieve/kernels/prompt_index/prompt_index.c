/* DSA's selection for a prompt's rows, on the CPU (the contract: native.py): per row, the lightning
 * indexer's scores of its causal prefix over the paged pool of index keys, and their `k` best (ties to
 * the lower position), written ascending. Rows of one request go in tiles of ROW_TILE: each 16-position
 * tile of keys is loaded and transposed once (index_tile) and scored for every row of the tile that
 * sees it, so only a tile of rows' scores [ROW_TILE, len] ever exists; the top-k of each row is the
 * radix select of decode_layer.c (top_ascending). Tiles spread over OpenMP threads.
 * Built with -O3 -march=native -fopenmp -fno-math-errno -ffp-contract=fast. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "index_score.h"
#include "page_rank.h"

#define ROW_TILE 16 /* rows sharing each loaded tile of keys */

/* Rows r0 .. r0 + R - 1 (one request: table row `slot`). Returns 0, -2 when out of memory. */
static int tile_select(const IndexPool* pool, const int32_t* table, int64_t table_stride, const int32_t* slots,
                       const int32_t* lens, const float* q, const float* w, int ih, int64_t k, int32_t* sel,
                       int64_t r0, int R) {
  int64_t max_len = 0;
  for (int r = 0; r < R; ++r) max_len = lens[r0 + r] > max_len ? lens[r0 + r] : max_len;
  const int64_t n_blocks = (max_len + pool->block_size - 1) / pool->block_size;
  const int64_t width = (max_len + INDEX_TILE - 1) / INDEX_TILE * INDEX_TILE;
  int64_t* blocks = (int64_t*)malloc(sizeof(int64_t) * (size_t)(n_blocks > 0 ? n_blocks : 1));
  float* score = (float*)malloc(sizeof(float) * (size_t)(width > 0 ? width : 1) * R);
  uint64_t* keys = (uint64_t*)malloc(sizeof(uint64_t) * (size_t)(max_len > 0 ? max_len : 1));
  int32_t* top = (int32_t*)malloc(sizeof(int32_t) * (size_t)(k + 1));
  if (blocks == NULL || score == NULL || keys == NULL || top == NULL) {
    free(blocks);
    free(score);
    free(keys);
    free(top);
    return -2;
  }
  const int32_t* trow = table + (int64_t)slots[r0] * table_stride;
  for (int64_t b = 0; b < n_blocks; ++b) blocks[b] = trow[b];
  const int id = pool->id;
  f32x16 cols[KV_MAX_D];
  for (int64_t p0 = 0; p0 < max_len; p0 += INDEX_TILE) {
    const int nt = (int)(max_len - p0 < INDEX_TILE ? max_len - p0 : INDEX_TILE);
    index_tile(pool, blocks, p0, nt, cols);
    for (int r = 0; r < R; ++r) {
      const int64_t n = r0 + r;
      if (lens[n] <= k || lens[n] <= p0) continue; /* a short row takes every position: no scores */
      const f32x16 out_t = tile_score(cols, q + n * (int64_t)ih * id, w + n * (int64_t)ih, ih, id);
      memcpy(score + r * width + p0, &out_t, sizeof(out_t));
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t n = r0 + r, len = lens[n];
    int32_t* dst = sel + n * k;
    const int64_t m = len <= k ? len : top_ascending(score + r * width, len, k, keys, top);
    for (int64_t i = 0; i < m; ++i) dst[i] = len <= k ? (int32_t)i : top[i];
    for (int64_t i = m; i < k; ++i) dst[i] = -1;
  }
  free(blocks);
  free(score);
  free(keys);
  free(top);
  return 0;
}

/* keys: the pool [num_blocks, block_size, id] (bf16 or fp32); row n belongs to the request of table
 * row slots[n] (table [., table_stride] int32 physical blocks; rows of one request consecutive) and
 * sees positions [0, lens[n]); q [n_rows, ih, id], w [n_rows, ih] fp32; sel [n_rows, k] int32: the k
 * best positions ascending (every position when lens[n] <= k), -1 after. Returns 0, -1 for shapes past
 * the kernels' (id > KV_MAX_D, ih > INDEX_MAX_H), -2 when out of memory. */
int kvsieve_prompt_index_topk(const void* keys, int is_bf16, int id, int64_t block_size, const int32_t* table,
                              int64_t table_stride, const int32_t* slots, const int32_t* lens, int64_t n_rows,
                              const float* q, const float* w, int ih, int64_t k, int32_t* sel) {
  if (id < 1 || id > KV_MAX_D || ih < 1 || ih > INDEX_MAX_H || k < 1 || block_size < 1) return -1;
  const IndexPool pool = {keys, is_bf16, id, block_size};
  /* tiles: ROW_TILE rows at most, never across two requests */
  int64_t* starts = (int64_t*)malloc(sizeof(int64_t) * (size_t)(n_rows + 1));
  if (starts == NULL) return -2;
  int64_t n_tiles = 0;
  for (int64_t n = 0; n < n_rows; ++n)
    if (n_tiles == 0 || n - starts[n_tiles - 1] == ROW_TILE || slots[n] != slots[n - 1]) starts[n_tiles++] = n;
  starts[n_tiles] = n_rows;
  int rc = 0;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < n_tiles; ++t) {
    if (tile_select(&pool, table, table_stride, slots, lens, q, w, ih, k, sel, starts[t],
                    (int)(starts[t + 1] - starts[t])) != 0) {
#pragma omp atomic write
      rc = -2;
    }
  }
  free(starts);
  return rc;
}
