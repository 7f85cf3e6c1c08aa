/* Attention of a prompt's query rows over runs of a paged cache, on the CPU (the contract:
 * native.py). Same runs and result as kvsieve_sparse_decode_runs (sparse_gqa_decode.c), another loop
 * order: a decode row reads each of its blocks once, cold; a prompt's neighbouring rows select mostly
 * the same blocks, so the rows are taken in tiles of TILE_ROWS per KV head and each tile visits its
 * runs block by block: per tile, the logits of every selected token, the softmax per (row, query
 * head), then the weighted V rows, block by block again. A block the tile's rows select densely enough
 * (BlockRows) is packed once and computed as two small matrix products; the others token by token.
 * Tiles x KV heads are spread over OpenMP threads, each with its own buffers (Scratch).
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

/* Logits of n <= LANES tokens for G query heads: s[g * stride + j] = sum over d, in order, of qh[g][d] * K_j[d],
 * token j's channel d at offs[j] + d * ch (K by channel: vLLM's CPU layout; ch = 1: rows). The tokens
 * go side by side (one fused multiply-add per head and channel for all of them), so no sum waits on
 * the one before; G and the dtype are constants at the call (tokens_logits), so the sums stay in
 * registers. */
#define LANES 8
typedef float f32x8 __attribute__((vector_size(32)));
static inline __attribute__((always_inline)) void lanes_logits(const void* k, const int BF16, const int64_t* offs,
                                                               int n, int64_t ch, int D, const float* qh, const int G,
                                                               float* s, int64_t stride) {
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
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < n; ++j) s[g * stride + j] = acc[g][j];
}

static void tokens_logits(const void* k, int is_bf16, const int64_t* offs, int n, int64_t ch, int D, const float* qh,
                          int G, float* s, int64_t stride) {
#define LANES_CASE(GG)                                                         \
  case GG:                                                                     \
    if (is_bf16) lanes_logits(k, 1, offs, n, ch, D, qh, GG, s, stride);                \
    else lanes_logits(k, 0, offs, n, ch, D, qh, GG, s, stride);                        \
    return;
  switch (G) {
    LANES_CASE(1)
    LANES_CASE(2)
    LANES_CASE(3)
    LANES_CASE(4)
    LANES_CASE(6)
    LANES_CASE(8)
    default:
      if (is_bf16) lanes_logits(k, 1, offs, n, ch, D, qh, G, s, stride);
      else lanes_logits(k, 0, offs, n, ch, D, qh, G, s, stride);
  }
#undef LANES_CASE
}

/* The dense form of one block for the rows of a tile that select in it: a block's runs of those rows
 * span in-block tokens [lo, hi); when the rows select at least a DENSE_SHARE-th of the (row, token)
 * pairs of that span, the logits of the whole span for every such row are one small matrix product
 * (K packed channel-major once, VL tokens a vector, RG_BLOCK (row, query head) pairs at a time) and the
 * weighted V rows another (V packed once, each selected weight applied to VL channels a vector); each
 * sum still runs over the channels, or the row's tokens, in order, so the values are those of the
 * token-by-token path (an unselected token adds weight 0). Else the rows take their tokens one by one. */
#define VL 16
#define RG_BLOCK 6
#define DENSE_SHARE 3
typedef float f32x16 __attribute__((vector_size(64)));

typedef struct {
  int n;                       /* rows of the tile selecting in the block */
  int rows[TILE_ROWS];         /* which rows (tile index), ascending */
  int64_t first[TILE_ROWS], last[TILE_ROWS]; /* each one's runs in the block: [first, last) */
  int groups;                  /* maximal groups of consecutive rows: rows[gi[j]] .. rows[gi[j + 1] - 1] */
  int gi[TILE_ROWS + 1];
  int64_t glo[TILE_ROWS], ghi[TILE_ROWS]; /* each group's span of in-block tokens [glo, ghi) */
  int dense[TILE_ROWS];        /* each group's form */
  int64_t lo, hi;              /* the span of the groups taking the dense form (lo >= hi: none) */
} BlockRows;

/* Group j's form once its rows are in: dense when it has whole vectors of channels and its rows select
 * at least a DENSE_SHARE-th of the (row, token) pairs of its span. */
static void close_group(BlockRows* br, int j, int64_t selected, int D) {
  br->dense[j] = D % VL == 0 && (br->n - br->gi[j]) * (br->ghi[j] - br->glo[j]) <= DENSE_SHARE * selected;
}

static void block_rows(BlockRows* br, int64_t b, const int64_t* cur, const int64_t* end, int R, const int64_t* blk,
                       const int64_t* start, const int32_t* cnt, int D) {
  int64_t selected = 0;
  br->n = br->groups = 0;
  br->lo = INT64_MAX;
  br->hi = 0;
  for (int r = 0; r < R; ++r) {
    if (cur[r] >= end[r] || blk[cur[r]] != b) continue;
    if (br->n == 0 || br->rows[br->n - 1] != r - 1) { /* a new group */
      const int j = br->groups;
      if (j > 0) close_group(br, j - 1, selected, D);
      br->gi[j] = br->n;
      br->glo[j] = INT64_MAX;
      br->ghi[j] = 0;
      br->groups = j + 1;
      selected = 0;
    }
    const int g = br->groups - 1;
    int64_t u = cur[r];
    for (; u < end[r] && blk[u] == b; ++u) {
      br->glo[g] = start[u] < br->glo[g] ? start[u] : br->glo[g];
      br->ghi[g] = start[u] + cnt[u] > br->ghi[g] ? start[u] + cnt[u] : br->ghi[g];
      selected += cnt[u];
    }
    br->rows[br->n] = r;
    br->first[br->n] = cur[r];
    br->last[br->n] = u;
    br->n++;
  }
  if (br->groups > 0) close_group(br, br->groups - 1, selected, D);
  br->gi[br->groups] = br->n;
  for (int g = 0; g < br->groups; ++g)
    if (br->dense[g]) {
      br->lo = br->glo[g] < br->lo ? br->glo[g] : br->lo;
      br->hi = br->ghi[g] > br->hi ? br->ghi[g] : br->hi;
    }
}

/* kp [D][w] (w = the span rounded up to VL, zero past it): channel d of the span's token t, fp32. */
static void pack_k(float* kp, int64_t w, const void* k, int is_bf16, int64_t k_base, int64_t ch, int64_t tok,
                   int64_t lo, int64_t hi, int D) {
  for (int d = 0; d < D; ++d) {
    float* row = kp + (int64_t)d * w;
    const int64_t o = k_base + lo * tok + (int64_t)d * ch;
    if (tok != 1) /* K rows of D: a strided read */
      for (int64_t t = 0; t < hi - lo; ++t) row[t] = load1(k, is_bf16, o + t * tok);
    else if (is_bf16) /* K by channel (vLLM's CPU layout): a channel's tokens side by side */
      for (int64_t t = 0; t < hi - lo; ++t) row[t] = bf16_to_f32(((const uint16_t*)k)[o + t]);
    else
      __builtin_memcpy(row, (const float*)k + o, sizeof(float) * (size_t)(hi - lo));
    for (int64_t t = hi - lo; t < w; ++t) row[t] = 0.0f;
  }
}

/* lg [n][w]: the logits of n (row, query head) pairs over the columns [c0, c1) of kp [D][w] (c0 and c1
 * multiples of VL); qt [n + RG_BLOCK][D] their query rows side by side (rows past n are read, their
 * logits not written); RG_BLOCK pairs at a time, VL tokens a vector. */
static void span_logits(const float* kp, int64_t w, int64_t c0, int64_t c1, const float* qt, int n, int D, float* lg) {
  for (int i0 = 0; i0 < n; i0 += RG_BLOCK) {
    const int m = n - i0 < RG_BLOCK ? n - i0 : RG_BLOCK;
    const float* qb = qt + (int64_t)i0 * D;
    for (int64_t t = c0; t < c1; t += VL) {
      f32x16 acc[RG_BLOCK];
      for (int i = 0; i < RG_BLOCK; ++i) acc[i] = (f32x16){0};
      const float* kt = kp + t;
      for (int d = 0; d < D; ++d) {
        f32x16 x;
        __builtin_memcpy(&x, kt + (int64_t)d * w, sizeof x);
        for (int i = 0; i < RG_BLOCK; ++i) acc[i] += qb[i * D + d] * x;
      }
      for (int i = 0; i < m; ++i) __builtin_memcpy(lg + (int64_t)(i0 + i) * w + t, &acc[i], sizeof acc[i]);
    }
  }
}

/* acc_i [D] += sum over the span's tokens t, in order, of p_i[t] * V_t for 4 pairs, NV vectors of
 * channels from d0 (the accumulators stay in registers over the span). */
static inline __attribute__((always_inline)) void values_tile(const float* vp, int64_t span, const float* const* pw,
                                                              float* const* acc, int D, int d0, const int NV) {
  f32x16 a[4][4];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < NV; ++j) __builtin_memcpy(&a[i][j], acc[i] + d0 + j * VL, sizeof(f32x16));
  for (int64_t t = 0; t < span; ++t) {
    f32x16 x[4];
    for (int j = 0; j < NV; ++j) __builtin_memcpy(&x[j], vp + t * D + d0 + j * VL, sizeof(f32x16));
    for (int i = 0; i < 4; ++i) {
      const float p = pw[i][t];
      for (int j = 0; j < NV; ++j) a[i][j] += p * x[j];
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < NV; ++j) __builtin_memcpy(acc[i] + d0 + j * VL, &a[i][j], sizeof(f32x16));
}

/* acc_i [D] += sum over the span's tokens t, in order, of pw_i[t] * V_t for n pairs (pw_i the weights,
 * 0 where not selected; vp [span][D] the packed V rows); pairs past n in a group of 4 read the zero
 * row `zeros` and write `spare`. */
static void span_values(const float* vp, int64_t span, float* const* pw, float* const* acc, int n, int D,
                        const float* zeros, float* spare) {
  for (int i0 = 0; i0 < n; i0 += 4) {
    const float* p4[4];
    float* a4[4];
    for (int i = 0; i < 4; ++i) {
      p4[i] = i0 + i < n ? pw[i0 + i] : zeros;
      a4[i] = i0 + i < n ? acc[i0 + i] : spare;
    }
    for (int d0 = 0; d0 < D; d0 += 4 * VL) {
      switch ((D - d0) / VL < 4 ? (D - d0) / VL : 4) {
        case 1: values_tile(vp, span, p4, a4, D, d0, 1); break;
        case 2: values_tile(vp, span, p4, a4, D, d0, 2); break;
        case 3: values_tile(vp, span, p4, a4, D, d0, 3); break;
        default: values_tile(vp, span, p4, a4, D, d0, 4);
      }
    }
  }
}

/* The softmax of n logits x (scaled by sm_scale) in place, unnormalized: x becomes exp(sm_scale * x -
 * max); returns the max in *mx and the sum. */
static float softmax_weights(float* x, int64_t n, float sm_scale, float* mx) {
  vm_f32x8 tops = (vm_f32x8){0} - INFINITY;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) { /* 8 running maxima, so no step waits on the one before */
    vm_f32x8 y;
    __builtin_memcpy(&y, x + j, sizeof y);
    y *= sm_scale;
    const vm_i32x8 gt = y > tops;
    tops = (vm_f32x8)((gt & (vm_i32x8)y) | (~gt & (vm_i32x8)tops));
  }
  float top = -INFINITY;
  for (int i = 0; i < 8; ++i) top = tops[i] > top ? tops[i] : top;
  for (; j < n; ++j) top = x[j] * sm_scale > top ? x[j] * sm_scale : top;
  vm_f32x8 acc = (vm_f32x8){0};
  j = 0;
  for (; j + 8 <= n; j += 8) {
    vm_f32x8 y;
    __builtin_memcpy(&y, x + j, sizeof y);
    y = exp8_nonpositive(y * sm_scale - top);
    __builtin_memcpy(x + j, &y, sizeof y);
    acc += y;
  }
  float sum = lane_sum(acc);
  for (; j < n; ++j) {
    x[j] = exp_nonpositive(x[j] * sm_scale - top);
    sum += x[j];
  }
  *mx = top;
  return sum;
}

/* One thread's buffers, kept across its tiles: s the logits (then weights) of a tile, acc its
 * accumulators [R][G][D], kv a packed block (K [D][w], then V [span][D]), lg a block's logits (then
 * weights) [R * G][w] and a row of zeros after them, qt the tile's queries [R * G + RG_BLOCK][D]. */
typedef struct {
  float *s, *acc, *kv, *lg, *qt;
  int64_t s_cap;
} Scratch;

static int scratch_init(Scratch* sc, int64_t w, int D, int G) {
  sc->s = NULL;
  sc->s_cap = 0;
  sc->acc = (float*)malloc(sizeof(float) * (size_t)TILE_ROWS * G * D);
  sc->kv = (float*)malloc(sizeof(float) * (size_t)w * D);
  sc->lg = (float*)calloc((size_t)(TILE_ROWS * G + 1) * w, sizeof(float)); /* its last row stays 0 */
  sc->qt = (float*)calloc((size_t)(TILE_ROWS * G + RG_BLOCK) * D, sizeof(float));
  return sc->acc != NULL && sc->kv != NULL && sc->lg != NULL && sc->qt != NULL;
}

static void scratch_free(Scratch* sc) {
  free(sc->s);
  free(sc->acc);
  free(sc->kv);
  free(sc->lg);
  free(sc->qt);
}

/* One (tile, KV head): rows n0..n0+R-1 of head h. Returns 0, -2 when out of memory. */
static int tile_attend(const void* k, const void* v, int is_bf16, int64_t k_ch, const int64_t* ptr,
                       const int64_t* blk, const int64_t* start, const int64_t* k_off, const int64_t* v_off,
                       const int32_t* cnt, int64_t n_rows, int hkv, int D, int64_t w, const float* q, int G,
                       float sm_scale, float* out, float* lse, int64_t n0, int R, int h, Scratch* sc) {
  int64_t cur[TILE_ROWS], end[TILE_ROWS], base[TILE_ROWS], tot[TILE_ROWS], fill[TILE_ROWS], total = 0;
  for (int r = 0; r < R; ++r) {
    cur[r] = ptr[h * n_rows + n0 + r];
    end[r] = ptr[h * n_rows + n0 + r + 1];
    base[r] = total * G; /* row r's logits: s[base[r] + g * tot[r] + j], its j-th token */
    tot[r] = 0;
    for (int64_t u = cur[r]; u < end[r]; ++u) tot[r] += cnt[u];
    total += tot[r];
  }
  if (total * G > sc->s_cap) {
    free(sc->s);
    sc->s_cap = total * G;
    sc->s = (float*)malloc(sizeof(float) * (size_t)sc->s_cap);
    if (sc->s == NULL) {
      sc->s_cap = 0;
      return -2;
    }
  }
  float *s = sc->s, *acc = sc->acc, *kv = sc->kv, *lg = sc->lg;
  for (int64_t i = 0; i < (int64_t)R * G * D; ++i) acc[i] = 0.0f;
  for (int r = 0; r < R; ++r) /* the tile's queries side by side: pair (r, g) is row r * G + g */
    __builtin_memcpy(sc->qt + (int64_t)r * G * D, q + ((n0 + r) * hkv + h) * (int64_t)G * D, sizeof(float) * G * D);
  float vrow[KV_MAX_D], spare[KV_MAX_D];
  BlockRows br;
  const int64_t ch = k_ch > 0 ? k_ch : 1, tok = k_ch > 0 ? 1 : D;
  float *ap[TILE_ROWS * KV_MAX_G], *pp[TILE_ROWS * KV_MAX_G];
  /* pass 1: the logits, block by block */
  int64_t offs[LANES];
  for (int r = 0; r < R; ++r) fill[r] = 0;
  for (int64_t b = next_block(cur, end, R, blk); b >= 0; b = next_block(cur, end, R, blk)) {
    block_rows(&br, b, cur, end, R, blk, start, cnt, D);
    const int64_t u0 = br.first[0];
    if (br.lo < br.hi) pack_k(kv, w, k, is_bf16, k_off[u0] - start[u0] * tok, ch, tok, br.lo, br.hi, D);
    for (int j = 0; j < br.groups; ++j) {
      if (br.dense[j]) {
        const int r0 = br.rows[br.gi[j]];
        const int64_t c0 = (br.glo[j] - br.lo) / VL * VL, c1 = (br.ghi[j] - br.lo + VL - 1) / VL * VL;
        span_logits(kv, w, c0, c1, sc->qt + (int64_t)r0 * G * D, (br.gi[j + 1] - br.gi[j]) * G, D, lg);
        for (int i = br.gi[j]; i < br.gi[j + 1]; ++i) {
          const int r = br.rows[i];
          for (int64_t u = br.first[i]; u < br.last[i]; fill[r] += cnt[u], ++u)
            for (int g = 0; g < G; ++g)
              __builtin_memcpy(s + base[r] + g * tot[r] + fill[r], lg + (int64_t)((r - r0) * G + g) * w + start[u] - br.lo,
                               sizeof(float) * (size_t)cnt[u]);
          cur[r] = br.last[i];
        }
        continue;
      }
      for (int i = br.gi[j]; i < br.gi[j + 1]; ++i) {
        const int r = br.rows[i];
        const float* qh = sc->qt + (int64_t)r * G * D;
        int n = 0;
        for (; cur[r] < br.last[i]; ++cur[r]) {
          const int64_t u = cur[r];
          for (int t = 0; t < cnt[u]; ++t) {
            offs[n++] = k_off[u] + t * tok;
            if (n == LANES) {
              tokens_logits(k, is_bf16, offs, n, ch, D, qh, G, s + base[r] + fill[r], tot[r]);
              fill[r] += n;
              n = 0;
            }
          }
        }
        if (n > 0) {
          tokens_logits(k, is_bf16, offs, n, ch, D, qh, G, s + base[r] + fill[r], tot[r]);
          fill[r] += n;
        }
      }
    }
  }
  /* the softmax of each (row, query head): s becomes the weights, unnormalized */
  float m[TILE_ROWS][KV_MAX_G], l[TILE_ROWS][KV_MAX_G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) l[r][g] = softmax_weights(s + base[r] + g * tot[r], tot[r], sm_scale, &m[r][g]);
  /* pass 2: the weighted V rows, block by block again (the same blocks take the dense form) */
  for (int r = 0; r < R; ++r) {
    cur[r] = ptr[h * n_rows + n0 + r];
    fill[r] = 0;
  }
  for (int64_t b = next_block(cur, end, R, blk); b >= 0; b = next_block(cur, end, R, blk)) {
    block_rows(&br, b, cur, end, R, blk, start, cnt, D);
    const int64_t u0 = br.first[0];
    if (br.lo < br.hi) { /* V rows [lo, hi) of the block, fp32: token t at kv[(t - lo) * D] */
      const int64_t vb = v_off[u0] - start[u0] * D + br.lo * D;
      for (int64_t t = 0; t < br.hi - br.lo; ++t)
        for (int d = 0; d < D; ++d) kv[t * D + d] = load1(v, is_bf16, vb + t * D + d);
    }
    for (int j = 0; j < br.groups; ++j) {
      if (br.dense[j]) {
        const int64_t c0 = br.glo[j] - br.lo, span = br.ghi[j] - br.glo[j];
        const float* zeros = lg + (int64_t)TILE_ROWS * G * w; /* never written: 0 from scratch_init */
        int n = 0;
        for (int i = br.gi[j]; i < br.gi[j + 1]; ++i, ++n) {
          const int r = br.rows[i];
          for (int g = 0; g < G; ++g) { /* the pair's weights over the group's span, 0 where not selected */
            float* pw = lg + (int64_t)(n * G + g) * w;
            for (int64_t t = 0; t < span; ++t) pw[t] = 0.0f;
            pp[n * G + g] = pw;
            ap[n * G + g] = acc + ((int64_t)r * G + g) * D;
          }
          for (int64_t u = br.first[i]; u < br.last[i]; fill[r] += cnt[u], ++u)
            for (int g = 0; g < G; ++g)
              __builtin_memcpy(lg + (int64_t)(n * G + g) * w + start[u] - br.glo[j], s + base[r] + g * tot[r] + fill[r],
                               sizeof(float) * (size_t)cnt[u]);
          cur[r] = br.last[i];
        }
        span_values(kv + c0 * D, span, pp, ap, n * G, D, zeros, spare);
        continue;
      }
      for (int i = br.gi[j]; i < br.gi[j + 1]; ++i) {
        const int r = br.rows[i];
        float* ar = acc + (int64_t)r * G * D;
        for (; cur[r] < br.last[i]; ++cur[r]) {
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
            const float* p = s + base[r] + fill[r];
            for (int g = 0; g < G; ++g) {
              const float pg = p[g * tot[r]];
              float* a = ar + g * D;
#pragma omp simd
              for (int d = 0; d < D; ++d) a[d] += pg * vrow[d];
            }
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
  return 0;
}

/* The runs of (row n, KV head h) are [ptr[h * n_rows + n], ptr[h * n_rows + n + 1]), ascending in
 * position; run u lies in cache block blk[u] (any id, the same for every run of that block) of bs
 * tokens, from its token start[u] of the block (its tokens start[u] .. start[u] + cnt[u] - 1); K of its
 * token t at k_off[u] + t * D of k (k_ch = 0: rows of D) or channel d at k_off[u] + t + d * k_ch (k_ch >
 * 0: K stored by channel), its V row at v_off[u] + t * D of v. q [n_rows, hkv, G, D] fp32; out
 * [n_rows, hkv, G, D] fp32; lse [n_rows, hkv, G] fp32 (natural log of the sum of exp(sm_scale * logit);
 * a (row, head) without tokens: out 0, lse +inf). Returns 0, -1 for shapes past KV_MAX_D/KV_MAX_G, -2
 * when out of memory. */
int kvsieve_prompt_runs(const void* k, const void* v, int is_bf16, int64_t k_ch, const int64_t* ptr,
                        const int64_t* blk, const int64_t* start, const int64_t* k_off, const int64_t* v_off,
                        const int32_t* cnt, int64_t n_rows, int hkv, int D, int bs, const float* q, int G,
                        float sm_scale, float* out, float* lse) {
  if (D > KV_MAX_D || G > KV_MAX_G || D < 1 || G < 1 || k_ch < 0 || bs < 1) return -1;
  const int64_t tiles = (n_rows + TILE_ROWS - 1) / TILE_ROWS;
  const int64_t w = ((int64_t)bs + VL - 1) / VL * VL; /* a packed block's row */
  int rc = 0;
#pragma omp parallel
  {
    Scratch sc;
    int ok = scratch_init(&sc, w, D, G);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tiles * hkv; ++task) {
      const int64_t n0 = (task / hkv) * TILE_ROWS;
      const int R = (int)(n_rows - n0 < TILE_ROWS ? n_rows - n0 : TILE_ROWS);
      if (!ok || tile_attend(k, v, is_bf16, k_ch, ptr, blk, start, k_off, v_off, cnt, n_rows, hkv, D, w, q, G,
                             sm_scale, out, lse, n0, R, (int)(task % hkv), &sc) != 0) {
#pragma omp atomic write
        rc = -2;
      }
    }
    scratch_free(&sc);
  }
  return rc;
}
