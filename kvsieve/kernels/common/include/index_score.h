/* The DSA lightning indexer's score of cached positions, I[p] = sum over heads h, in order, of
 * w[h] * relu(q[h] . k[p]), over a paged pool of index keys (decode_layer.c's INDEXER program);
 * included, not compiled alone. The pool is [num_blocks, block_size, id] (bf16 or fp32, a row of id
 * channels a position); the math is fp32. On a CPU with AVX512-BF16, a bf16 pool scored with a q of bf16
 * values (as the plug-in's) takes the pairs pass: each product is the same exact fp32 value, added to the
 * sum a channel pair at a time by the bf16 dot-product instruction, so a sum may differ from the fp32
 * pass's in its last bits. */
#ifndef KVSIEVE_INDEX_SCORE_H
#define KVSIEVE_INDEX_SCORE_H
#include <stdint.h>
#include <string.h>

#include "attend_runs.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#define INDEX_PAIRS 1 /* the CPU multiplies bf16 pairs and adds both products to an fp32 sum in one instruction */
#else
#define INDEX_PAIRS 0
#endif

#define INDEX_MAX_H 64 /* indexer heads the kernels take at most */
#define INDEX_TILE 16 /* positions scored together (one f32x16) */
#define INDEX_PREFETCH 8 /* tiles ahead whose keys are requested */
#define INDEX_HEADS_PASS 8 /* indexer heads whose sums one pass over a tile's channels accumulates */

typedef struct { /* a paged pool of index keys: position p of a row at row (blocks[p / block_size] * block_size + p % block_size) */
  const void* keys;
  int is_bf16, id;
  int64_t block_size;
} IndexPool;

/* 16 rows of 16 32-bit lanes transposed in place (lane l of row i <-> lane i of row l): for b = 8, 4, 2, 1
 * rows i and i + b swap their off-diagonal b x b blocks, each pair by two two-source shuffles whose
 * lane maps are constants (one register permute each). */
static inline __attribute__((always_inline)) void transpose16(u32x16 r[16]) {
#define TRANSPOSE_LEVEL(b, LO, HI)                                   \
  for (int i = 0; i < 16; ++i) {                                     \
    if (i & (b)) continue;                                           \
    const u32x16 x = r[i], y = r[i + (b)];                           \
    r[i] = __builtin_shuffle(x, y, (u32x16)LO);                      \
    r[i + (b)] = __builtin_shuffle(x, y, (u32x16)HI);                \
  }
  /* level b: lane l of the low row takes x[l] where l & b is 0, else y[l - b]; the high row x[l + b], else y[l] */
  TRANSPOSE_LEVEL(8, ((u32x16){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}),
                  ((u32x16){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}))
  TRANSPOSE_LEVEL(4, ((u32x16){0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}),
                  ((u32x16){4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}))
  TRANSPOSE_LEVEL(2, ((u32x16){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}),
                  ((u32x16){2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}))
  TRANSPOSE_LEVEL(1, ((u32x16){0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}),
                  ((u32x16){1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}))
#undef TRANSPOSE_LEVEL
}

/* Whether the tile of nt positions from p0 is 16 consecutive rows of the pool (one cache block's). */
static inline int tile_in_block(const IndexPool* pool, int64_t p0, int nt) {
  return nt == INDEX_TILE && p0 % pool->block_size + INDEX_TILE <= pool->block_size;
}

/* Lanes [c0, c0 + 16) (32 bits each: one fp32 channel or two bf16 ones) of the 16 rows from p0
 * (tile_in_block), transposed: r[c] lane t = lane c0 + c of position p0 + t. */
static inline __attribute__((always_inline)) void tile_lanes(const IndexPool* pool, const int64_t* blocks,
                                                             int64_t p0, int c0, u32x16 r[16]) {
  const int64_t bs = pool->block_size, row_bytes = (int64_t)pool->id * (pool->is_bf16 ? 2 : 4);
  const char* base = (const char*)pool->keys + (blocks[p0 / bs] * bs + p0 % bs) * row_bytes + c0 * 4;
  for (int t = 0; t < 16; ++t) memcpy(&r[t], base + t * row_bytes, sizeof(u32x16));
  transpose16(r);
}

/* out + w * relu(acc): one head's term of the score (heads added in order). */
static inline f32x16 add_relu_weighted(f32x16 out, f32x16 acc, float w) {
  const f32x16 relu = (f32x16)((u32x16)acc & (u32x16)(acc > (f32x16){0})); /* acc > 0 ? acc : 0 */
  return out + w * relu;
}

/* Index keys of positions [p0, p0 + nt) (nt <= 16) as channel columns: cols[d] lane t = channel d of
 * position p0 + t (lanes past nt repeat position p0). Sixteen positions in one cache block are 16
 * consecutive rows of the pool, transposed 16 x 16 lanes at a time (a 32-bit lane holds two bf16
 * channels); any other tile one position at a time. */
static void index_tile(const IndexPool* pool, const int64_t* blocks, int64_t p0, int nt, f32x16* cols) {
  const int id = pool->id;
  const int64_t bs = pool->block_size;
  const int per_lane = pool->is_bf16 ? 2 : 1; /* channels in a 32-bit lane */
  if (tile_in_block(pool, p0, nt) && id % (16 * per_lane) == 0) {
    for (int c0 = 0; c0 < id / per_lane; c0 += 16) { /* 16 lanes (16 or 32 channels) of the 16 rows */
      u32x16 r[16];
      tile_lanes(pool, blocks, p0, c0, r);
      for (int c = 0; c < 16; ++c) {
        if (pool->is_bf16) {
          const u32x16 lo = r[c] << 16, hi = r[c] & 0xFFFF0000u;
          memcpy(&cols[2 * (c0 + c)], &lo, sizeof(lo));
          memcpy(&cols[2 * (c0 + c) + 1], &hi, sizeof(hi));
        } else {
          memcpy(&cols[c0 + c], &r[c], sizeof(r[c]));
        }
      }
    }
    return;
  }
  float row[KV_MAX_D];
  for (int t = 0; t < INDEX_TILE; ++t) {
    const int64_t p = p0 + (t < nt ? t : 0);
    load_row(pool->keys, pool->is_bf16, (blocks[p / bs] * bs + p % bs) * id, id, row);
    for (int d = 0; d < id; ++d) cols[d][t] = row[d];
  }
}

#if INDEX_PAIRS
/* q [ih, id] as bf16 pairs for the pairs pass (a bf16 pool, id a multiple of 32):
 * pairs[h * id / 2 + c] holds q[h][2c]'s bits in its low half and q[h][2c + 1]'s in its high half.
 * Returns 0, and the fp32 pass scores every tile, when the pass does not apply or some element of q is
 * not a bf16 value (the plug-in rounds q to the bf16 pool's precision: a bf16 q times a bf16 key is
 * exact in fp32 either way). */
static int index_q_pairs(const IndexPool* pool, const float* q, int ih, uint32_t* pairs) {
  if (!pool->is_bf16 || pool->id % 32) return 0;
  const int64_t n = (int64_t)ih * pool->id;
  for (int64_t i = 0; i < n; i += 2) {
    uint32_t lo, hi;
    memcpy(&lo, q + i, sizeof(lo));
    memcpy(&hi, q + i + 1, sizeof(hi));
    if ((lo | hi) & 0xFFFFu) return 0;
    pairs[i / 2] = (lo >> 16) | (hi & 0xFFFF0000u);
  }
  return 1;
}

/* The score of 16 positions [p0, p0 + 16) of one cache block from a bf16 pool, q as pairs
 * (index_q_pairs): the rows transposed 16 x 16 lanes (a 32-bit lane, two channels, of each position),
 * then per head one bf16 dot-product instruction a channel pair, which adds the pair's two exact
 * products to the head's fp32 sum; heads in order as the fp32 pass. */
static inline f32x16 index_tile_pairs(const IndexPool* pool, const int64_t* blocks, int64_t p0, const uint32_t* qp,
                                      const float* w, int ih) {
  const int np = pool->id / 2;
  __m512i cols[KV_MAX_D / 2];
  for (int c0 = 0; c0 < np; c0 += 16) {
    u32x16 r[16];
    tile_lanes(pool, blocks, p0, c0, r);
    for (int c = 0; c < 16; ++c) memcpy(&cols[c0 + c], &r[c], sizeof(r[c]));
  }
  f32x16 out = (f32x16){0};
  for (int h0 = 0; h0 < ih; h0 += INDEX_HEADS_PASS) {
    const int nh = ih - h0 < INDEX_HEADS_PASS ? ih - h0 : INDEX_HEADS_PASS;
    const uint32_t* qh = qp + (int64_t)h0 * np;
    __m512 acc[INDEX_HEADS_PASS];
    for (int j = 0; j < INDEX_HEADS_PASS; ++j) acc[j] = _mm512_setzero_ps();
#define PAIRS_PASS(NH)                                                                                    \
  for (int c = 0; c < np; ++c)                                                                            \
    for (int j = 0; j < (NH); ++j)                                                                        \
      acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_set1_epi32((int)qh[(int64_t)j * np + c]), (__m512bh)cols[c]);
    if (nh == INDEX_HEADS_PASS) PAIRS_PASS(INDEX_HEADS_PASS) /* a constant count: the sums stay in registers */
    else PAIRS_PASS(nh)
#undef PAIRS_PASS
    for (int j = 0; j < nh; ++j) {
      f32x16 a;
      memcpy(&a, &acc[j], sizeof(a));
      out = add_relu_weighted(out, a, w[h0 + j]);
    }
  }
  return out;
}
#endif

/* Ask for the keys of the tile at p0 (its positions below len) while earlier tiles are scored: blocks
 * lie anywhere in the pool, so the hardware's stream prefetch restarts at every block. */
static inline void index_prefetch(const IndexPool* pool, const int64_t* blocks, int64_t p0, int64_t len) {
  const int64_t bs = pool->block_size, row_bytes = (int64_t)pool->id * (pool->is_bf16 ? 2 : 4);
  const int64_t n = len - p0 < INDEX_TILE ? len - p0 : INDEX_TILE;
  for (int64_t p = p0; p < p0 + n;) { /* the tile's pieces in each cache block */
    const int64_t in_blk = bs - p % bs < p0 + n - p ? bs - p % bs : p0 + n - p;
    prefetch_span((const char*)pool->keys + (blocks[p / bs] * bs + p % bs) * row_bytes, in_blk * row_bytes);
    p += in_blk;
  }
}

/* The scores of a tile's 16 positions (cols: index_tile's) for the indexer's q [ih, id] and weights
 * w [ih] fp32: the heads' terms added in order. */
static inline f32x16 tile_score(const f32x16* cols, const float* q, const float* w, int ih, int id) {
  f32x16 out_t = (f32x16){0};
  for (int h0 = 0; h0 < ih; h0 += INDEX_HEADS_PASS) { /* a channel feeds several heads' sums at once */
    const int nh = ih - h0 < INDEX_HEADS_PASS ? ih - h0 : INDEX_HEADS_PASS;
    f32x16 acc[INDEX_HEADS_PASS];
    for (int j = 0; j < INDEX_HEADS_PASS; ++j) acc[j] = (f32x16){0};
    const float* qh = q + (int64_t)h0 * id;
    if (nh == INDEX_HEADS_PASS) { /* a constant count: the 8 sums stay in registers */
      for (int d = 0; d < id; ++d)
        for (int j = 0; j < INDEX_HEADS_PASS; ++j) acc[j] += qh[(int64_t)j * id + d] * cols[d];
    } else {
      for (int d = 0; d < id; ++d)
        for (int j = 0; j < nh; ++j) acc[j] += qh[(int64_t)j * id + d] * cols[d];
    }
    for (int j = 0; j < nh; ++j) out_t = add_relu_weighted(out_t, acc[j], w[h0 + j]); /* heads in order */
  }
  return out_t;
}

/* score[p] for the tiles t0 <= t < t1 of positions [0, len) (tile t: positions 16t .. 16t + 15): the
 * indexer's q [ih, id] and weights w [ih] fp32 against the pool's keys. Each tile's score is its own
 * (the tiles may be split among threads). */
static void index_scores(const IndexPool* pool, const int64_t* blocks, int64_t len, const float* q, const float* w,
                         int ih, int64_t t0, int64_t t1, float* score) {
  const int id = pool->id;
  f32x16 cols[KV_MAX_D]; /* a tile of 16 positions channel-major: a head's dots are a vector op a channel */
#if INDEX_PAIRS
  uint32_t qp[INDEX_MAX_H * KV_MAX_D / 2];
  const int pairs = index_q_pairs(pool, q, ih, qp);
#endif
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t p0 = t * INDEX_TILE;
    const int nt = (int)(len - p0 < INDEX_TILE ? len - p0 : INDEX_TILE);
    if (t + INDEX_PREFETCH < t1) index_prefetch(pool, blocks, (t + INDEX_PREFETCH) * INDEX_TILE, len);
#if INDEX_PAIRS
    if (pairs && tile_in_block(pool, p0, nt)) {
      const f32x16 out_t = index_tile_pairs(pool, blocks, p0, qp, w, ih);
      memcpy(score + p0, &out_t, sizeof(out_t));
      continue;
    }
#endif
    index_tile(pool, blocks, p0, nt, cols);
    const f32x16 out_t = tile_score(cols, q, w, ih, id);
    memcpy(score + p0, &out_t, sizeof(float) * (size_t)nt);
  }
}

#endif
