/* One attention layer's decode step on the CPU in one call: the selector's per-step state update,
 * its selection, the runs of the paged cache it selects, and the attention over them (the op's
 * contract: decode_layer/__init__.py). Every row is one request's one new token, already in the cache.
 *
 * Programs (kind):
 *   PAGES         Quest / RocketKV stage 2: refresh the newest page's min/max summary from the cache,
 *                 rank pages (page_rank.h: softmax over pages, mean over the group, newest forced),
 *                 keep min(units, pages).
 *   STREAMING     the first num_sink positions and the last units - num_sink.
 *   TOKENS_EXACT  oracle top-k: the true attention probabilities summed over the group, per unit of
 *                 `unit` positions; keep min(units, its units).
 *   BLOCKS_EXACT  block selection: per block of `unit` positions the group's largest logit (mode 0)
 *                 or logit against the block's mean key (mode 1); the first init_units and last
 *                 local_units forced; keep min(units, blocks).
 *   BLOCKS_BOUND  the same from page min/max summaries (Quest's bound, group max); the newest page
 *                 refreshed first.
 *   INDEXER       DSA: write this token's index key, score I[s] = sum_h w[h] relu(q[h] . k[s]), keep
 *                 the `units` best positions (every position when there are no more); one set for
 *                 every KV head.
 * Ties rank the lower unit first. K/V/pools are read where they lie (bf16 or fp32); the math is fp32.
 * Built with -O3 -march=native -fopenmp-simd -fno-math-errno. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attend_runs.h"
#include "page_rank.h"

enum { KIND_PAGES = 1, KIND_STREAMING = 2, KIND_TOKENS_EXACT = 3, KIND_BLOCKS_EXACT = 4, KIND_BLOCKS_BOUND = 5,
       KIND_INDEXER = 6 };
#define INDEX_MAX_H 64 /* indexer heads the kernel takes at most */
#define INDEX_TILE 16 /* positions scored together (one f32x16) */
#define INDEX_HEADS_PASS 8 /* indexer heads whose sums one pass over a tile's channels accumulates */
#define SPAN_GAP 64   /* tokens between two pieces of one block that one span covers, less than */

enum { OK = 0, ERR_SHAPE = -1, ERR_MEMORY = -2, ERR_TABLE = -3, ERR_KIND = -4 };

/* Mirrored field by field by decode_layer/native.py's DecodeLayerArgs. */
typedef struct {
  /* the step: n_rows decode rows; row n's blocks table[n * table_stride + j], j < table_width */
  int64_t n_rows;
  const int32_t* table;
  int64_t table_stride, table_width;
  const int32_t* kv_lens;
  /* the layer's cache: K element (b, h, t, d) at k[b*k_blk + h*k_head + t*k_tok + d*k_ch], V rows of D */
  const void* k;
  const void* v;
  int64_t k_blk, k_head, k_tok, k_ch, v_blk, v_head, v_tok, num_blocks;
  int32_t kv_bf16, block_size, hkv, D, G;
  float sm_scale;
  /* q, out [n_rows, hkv * G, D]: row n at n * q_stride / n * out_stride elements, heads D apart */
  const void* q;
  void* out;
  int64_t q_stride, out_stride;
  int32_t q_bf16, out_bf16;
  /* the program */
  int32_t kind, mode, unit, num_sink, init_units, local_units;
  int64_t units;
  /* page summaries: (min, max) rows of 2*D at ((block * hkv + h) * pool_sub + s) * 2*D */
  void* pool;
  int32_t pool_bf16, pool_sub, page_size, ih;
  /* indexer: key pool [num_blocks, block_size, id]; q [n_rows, ih, id], w [n_rows, ih], new keys [n_rows, id] fp32 */
  void* ik;
  const float* iq;
  const float* iw;
  const float* ik_new;
  int32_t ik_bf16, id;
  /* out: positions each (row, KV head) attends [n_rows, hkv] */
  int64_t* attended;
} DecodeLayerArgs;

typedef struct { /* one call's scratch, sized for its longest row */
  float* scores;   /* [(G + hkv + 1) * n_max] */
  uint64_t* keys;  /* [n_max] */
  int32_t* sel;    /* [hkv * n_max] unit ids per head */
  int64_t* ra;     /* [n_max + 2] range starts */
  int64_t* rb;     /* [n_max + 2] range ends */
  int64_t *k_off, *v_off; /* [max_runs] */
  int32_t* cnt;    /* [max_runs] */
  int64_t* blocks; /* [table_width] int64 block ids of the row */
  int32_t* keep;   /* [n_max] spans' kept offsets (RunSpans) */
  int64_t* at;     /* [max_runs] */
  int32_t* kept;   /* [max_runs] */
  int64_t max_runs;
} Scratch;

static inline float load_f(const void* base, int is_bf16, int64_t i) {
  return is_bf16 ? bf16_to_f32(((const uint16_t*)base)[i]) : ((const float*)base)[i];
}

/* The k best of score[0..n) (ties to the lower index) written ascending to out; returns k. */
static int64_t top_ascending(const float* score, int64_t n, int64_t k, uint64_t* keys, int32_t* out) {
  if (k >= n) {
    for (int64_t i = 0; i < n; ++i) out[i] = (int32_t)i;
    return n;
  }
  for (int64_t i = 0; i < n; ++i) keys[i] = rank_key(score[i], i);
  uint64_t kth = kth_largest(keys, n, k);
  int64_t m = 0;
  for (int64_t i = 0; i < n && m < k; ++i)
    if (rank_key(score[i], i) >= kth) out[m++] = (int32_t)i;
  return m;
}

/* 16 rows of 16 32-bit lanes transposed in place (lane l of row i <-> lane i of row l): for b = 8, 4, 2, 1
 * rows i and i + b swap their off-diagonal b x b blocks. */
static void transpose16(u32x16 r[16]) {
  for (int b = 8; b >= 1; b /= 2) {
    u32x16 lo_mask, hi_mask;
    for (int l = 0; l < 16; ++l) {
      lo_mask[l] = (uint32_t)((l & b) ? 16 + l - b : l);
      hi_mask[l] = (uint32_t)((l & b) ? 16 + l : l + b);
    }
    for (int i = 0; i < 16; ++i) {
      if (i & b) continue;
      const u32x16 x = r[i], y = r[i + b];
      r[i] = __builtin_shuffle(x, y, lo_mask);
      r[i + b] = __builtin_shuffle(x, y, hi_mask);
    }
  }
}

/* Index keys of positions [p0, p0 + nt) (nt <= 16) as channel columns: cols[d] lane t = channel d of
 * position p0 + t (lanes past nt repeat position p0). Sixteen positions in one cache block are 16
 * consecutive rows of the pool, transposed 16 x 16 lanes at a time (a 32-bit lane holds two bf16
 * channels); any other tile one position at a time. */
static void index_tile(const DecodeLayerArgs* a, const int64_t* blocks, int64_t p0, int nt, f32x16* cols) {
  const int id = a->id;
  const int64_t bs = a->block_size;
  const int es = a->ik_bf16 ? 2 : 4, per_lane = 4 / es; /* bytes an element; channels in a 32-bit lane */
  if (nt == INDEX_TILE && p0 % bs + INDEX_TILE <= bs && id % (16 * per_lane) == 0) {
    const int64_t row_bytes = (int64_t)id * es;
    const char* base = (const char*)a->ik + (blocks[p0 / bs] * bs + p0 % bs) * row_bytes;
    for (int c0 = 0; c0 < id / per_lane; c0 += 16) { /* 16 lanes (16 or 32 channels) of the 16 rows */
      u32x16 r[16];
      for (int t = 0; t < 16; ++t) memcpy(&r[t], base + t * row_bytes + c0 * 4, sizeof(u32x16));
      transpose16(r);
      for (int c = 0; c < 16; ++c) {
        if (a->ik_bf16) {
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
    load_row(a->ik, a->ik_bf16, (blocks[p / bs] * bs + p % bs) * id, id, row);
    for (int d = 0; d < id; ++d) cols[d][t] = row[d];
  }
}

/* Units (ascending ids) of `unit` positions, clipped to len, as ranges [ra, rb) merged where they touch. */
static int64_t units_to_ranges(const int32_t* sel, int64_t m, int64_t unit, int64_t len, int64_t* ra, int64_t* rb) {
  int64_t r = 0;
  for (int64_t i = 0; i < m; ++i) {
    int64_t a = (int64_t)sel[i] * unit, b = a + unit < len ? a + unit : len;
    if (a >= b) continue;
    if (r > 0 && rb[r - 1] == a) rb[r - 1] = b;
    else { ra[r] = a; rb[r] = b; ++r; }
  }
  return r;
}

/* Head h's ranges as runs inside cache blocks (element offsets of K and V, token counts). With K
 * stored by channel (use_spans), pieces of ranges in one cache block less than SPAN_GAP tokens
 * apart become one span (attend_runs.h's RunSpans) of at most SPAN_MAX tokens, its kept offsets in
 * s->keep: a K cache line holds 16-32 tokens of a channel, so scattered tokens read nearly every line
 * of their block either way, and a span reads them in order. *total: the tokens attended. */
static int64_t ranges_to_runs(const DecodeLayerArgs* a, const int64_t* blocks, int h, const int64_t* ra,
                              const int64_t* rb, int64_t n_ranges, Scratch* s, int use_spans, int64_t* total) {
  int64_t r = 0, nk = 0, bs = a->block_size, last_blk = -1, span0 = 0; /* span0: the open span's first offset */
  *total = 0;
  for (int64_t i = 0; i < n_ranges; ++i) {
    for (int64_t p = ra[i]; p < rb[i];) {
      int64_t blk = p / bs, off = p % bs, end = (blk + 1) * bs < rb[i] ? (blk + 1) * bs : rb[i];
      int64_t n = end - p, end_off = off + n;
      *total += n;
      const int64_t gap = off - (span0 + (r > 0 ? s->cnt[r - 1] : 0));
      if (use_spans && r > 0 && blk == last_blk && gap >= 0 && gap < SPAN_GAP && end_off - span0 <= SPAN_MAX) {
        if (s->at[r - 1] < 0) { /* the open run becomes a span: its own tokens kept first */
          s->at[r - 1] = nk;
          for (int32_t j = 0; j < s->cnt[r - 1]; ++j) s->keep[nk++] = j;
          s->kept[r - 1] = s->cnt[r - 1];
        }
        for (int64_t j = off; j < end_off; ++j) s->keep[nk++] = (int32_t)(j - span0);
        s->kept[r - 1] += (int32_t)n;
        s->cnt[r - 1] = (int32_t)(end_off - span0);
      } else {
        int64_t b = blocks[blk];
        if (r >= s->max_runs) return -1;
        s->k_off[r] = b * a->k_blk + h * a->k_head + off * a->k_tok;
        s->v_off[r] = b * a->v_blk + h * a->v_head + off * a->v_tok;
        s->cnt[r] = (int32_t)n;
        s->at[r] = -1; /* every token (kept[r] is read for spans only) */
        last_blk = blk;
        span0 = off;
        ++r;
      }
      p = end;
    }
  }
  return r;
}

/* Query row n as fp32 [hkv * G * D]. */
static void load_q(const DecodeLayerArgs* a, int64_t n, float* qf) {
  int64_t w = (int64_t)a->hkv * a->G * a->D;
  for (int64_t i = 0; i < w; ++i) qf[i] = load_f(a->q, a->q_bf16, n * a->q_stride + i);
}

/* Logits of query head row qh [D] against positions [0, len) of KV head h, times sm_scale. */
static void head_logits_all(const DecodeLayerArgs* a, const int64_t* blocks, int h, const float* qh, int64_t len,
                            float* out) {
  float row[KV_MAX_D];
  for (int64_t p = 0; p < len; ++p) out[p] = 0.0f;
  for (int64_t blk = 0; blk * a->block_size < len; ++blk) {
    int64_t p0 = blk * a->block_size, n = len - p0 < a->block_size ? len - p0 : a->block_size;
    int64_t base = blocks[blk] * a->k_blk + h * a->k_head;
    if (a->k_ch == 1) { /* channels contiguous: a row of D per token */
      for (int64_t t = 0; t < n; ++t) {
        load_row(a->k, a->kv_bf16, base + t * a->k_tok, a->D, row);
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int d = 0; d < a->D; ++d) acc += qh[d] * row[d];
        out[p0 + t] = acc;
      }
    } else { /* K stored by channel (tokens contiguous): accumulate channel by channel */
      for (int d = 0; d < a->D; ++d) {
        float qd = qh[d];
        for (int64_t t0 = 0; t0 < n; t0 += KV_MAX_D) {
          int m = (int)(n - t0 < KV_MAX_D ? n - t0 : KV_MAX_D);
          load_row(a->k, a->kv_bf16, base + d * a->k_ch + t0 * a->k_tok, m, row);
          float* o = out + p0 + t0;
#pragma omp simd
          for (int j = 0; j < m; ++j) o[j] += qd * row[j];
        }
      }
    }
  }
  for (int64_t p = 0; p < len; ++p) out[p] *= a->sm_scale;
}

/* The summary of the page holding position len - 1, positions up to it: the new token alone when it
 * opens the page, else the page's summary over [first, len - 1) (which every earlier step wrote) widened
 * by the new token. Rounding to the summary dtype is monotonic, so this equals recomputing the page. */
static int refresh_newest_page(const DecodeLayerArgs* a, const int64_t* blocks, int64_t len) {
  const int64_t ps = a->page_size, d = a->D, pos = len - 1, first = pos / ps * ps;
  const int64_t blk = blocks[pos / a->block_size], tok = pos % a->block_size;
  const int opens = pos == first;
  for (int h = 0; h < a->hkv; ++h) {
    const int64_t src = blk * a->k_blk + h * a->k_head + tok * a->k_tok;
    const int64_t dst = ((blk * a->hkv + h) * a->pool_sub + (first % a->block_size) / ps) * 2 * d;
    for (int64_t c = 0; c < d; ++c) {
      float x = load_f(a->k, a->kv_bf16, src + c * a->k_ch);
      float lo = x, hi = x;
      if (!opens) {
        float old_lo = load_f(a->pool, a->pool_bf16, dst + c), old_hi = load_f(a->pool, a->pool_bf16, dst + d + c);
        lo = x != x || old_lo != old_lo ? x + old_lo : (old_lo < x ? old_lo : x); /* NaN stays NaN */
        hi = x != x || old_hi != old_hi ? x + old_hi : (old_hi > x ? old_hi : x);
      }
      if (a->pool_bf16) {
        ((uint16_t*)a->pool)[dst + c] = f32_to_bf16(lo);
        ((uint16_t*)a->pool)[dst + d + c] = f32_to_bf16(hi);
      } else {
        ((float*)a->pool)[dst + c] = lo;
        ((float*)a->pool)[dst + d + c] = hi;
      }
    }
  }
  return OK;
}

/* Per head, the selected units of row n into s->sel (head h at h * n_max), counts in m[h]. */
static int select_units(const DecodeLayerArgs* a, int64_t n, const int64_t* blocks, int64_t len, const float* qf,
                        Scratch* s, int64_t n_max, int64_t* m) {
  const int hkv = a->hkv, G = a->G, D = a->D;
  const int64_t unit = a->unit, n_units = (len + unit - 1) / unit, k = a->units < n_units ? a->units : n_units;
  switch (a->kind) {
    case KIND_PAGES: {
      if (refresh_newest_page(a, blocks, len) != OK) return ERR_SHAPE;
      float* logits = s->scores;
      float* scores = s->scores + (int64_t)G * n_max;
      /* blocks are in units of cache blocks; the ranker walks pool_sub pages per block */
      topk_row(a->pool, a->pool_bf16, blocks, n_units, hkv, a->pool_sub, D, qf, G, a->sm_scale, a->mode, k, scores,
               s->sel, n_max, logits, s->keys);
      for (int h = 0; h < hkv; ++h) m[h] = k;
      return OK;
    }
    case KIND_TOKENS_EXACT: {
      float* logits = s->scores;
      float* mass = s->scores + (int64_t)G * n_max;
      for (int h = 0; h < hkv; ++h) {
        for (int64_t u = 0; u < n_units; ++u) mass[u] = 0.0f;
        for (int g = 0; g < G; ++g) {
          float* l = logits + (int64_t)g * n_max;
          head_logits_all(a, blocks, h, qf + ((int64_t)h * G + g) * D, len, l);
          float mx = -INFINITY, sum = 0.0f;
          for (int64_t p = 0; p < len; ++p) mx = l[p] > mx ? l[p] : mx;
#pragma omp simd reduction(+ : sum)
          for (int64_t p = 0; p < len; ++p) { l[p] = exp_nonpositive(l[p] - mx); sum += l[p]; }
          float inv = 1.0f / sum;
          for (int64_t p = 0; p < len; ++p) mass[p / unit] += l[p] * inv;
        }
        m[h] = top_ascending(mass, n_units, k, s->keys, s->sel + h * n_max);
      }
      return OK;
    }
    case KIND_BLOCKS_EXACT:
    case KIND_BLOCKS_BOUND: {
      float* score = s->scores + (int64_t)G * n_max;
      if (a->kind == KIND_BLOCKS_BOUND && refresh_newest_page(a, blocks, len) != OK) return ERR_SHAPE;
      const int64_t ps = a->kind == KIND_BLOCKS_BOUND ? a->page_size : 1, n_pages = (len + ps - 1) / ps, per = unit / ps;
      for (int h = 0; h < hkv; ++h) {
        for (int64_t u = 0; u < n_units; ++u) score[u] = -INFINITY;
        if (a->kind == KIND_BLOCKS_BOUND) {
          float lo[KV_MAX_D], hi[KV_MAX_D];
          for (int64_t u = 0; u < n_units; ++u) {
            for (int d = 0; d < D; ++d) { lo[d] = INFINITY; hi[d] = -INFINITY; }
            for (int64_t pg = u * per; pg < (u + 1) * per && pg < n_pages; ++pg) {
              int64_t row = ((blocks[pg / a->pool_sub] * hkv + h) * a->pool_sub + pg % a->pool_sub) * 2 * D;
              for (int d = 0; d < D; ++d) {
                float x = load_f(a->pool, a->pool_bf16, row + d), y = load_f(a->pool, a->pool_bf16, row + D + d);
                lo[d] = x < lo[d] ? x : lo[d];
                hi[d] = y > hi[d] ? y : hi[d];
              }
            }
            for (int g = 0; g < G; ++g) {
              const float* qg = qf + ((int64_t)h * G + g) * D;
              float acc = 0.0f;
              for (int d = 0; d < D; ++d) acc += qg[d] > 0.0f ? qg[d] * hi[d] : qg[d] * lo[d];
              acc *= a->sm_scale;
              score[u] = acc > score[u] ? acc : score[u];
            }
          }
        } else if (a->mode == 0) { /* the group's largest logit in the block */
          float* l = s->scores;
          for (int g = 0; g < G; ++g) {
            head_logits_all(a, blocks, h, qf + ((int64_t)h * G + g) * D, len, l);
            for (int64_t p = 0; p < len; ++p) score[p / unit] = l[p] > score[p / unit] ? l[p] : score[p / unit];
          }
        } else { /* the logit against the block's mean key (positions < len): the block's logits averaged */
          float* l = s->scores;
          for (int g = 0; g < G; ++g) {
            head_logits_all(a, blocks, h, qf + ((int64_t)h * G + g) * D, len, l);
            for (int64_t u = 0; u < n_units; ++u) {
              int64_t p0 = u * unit, p1 = p0 + unit < len ? p0 + unit : len;
              float acc = 0.0f;
              for (int64_t p = p0; p < p1; ++p) acc += l[p];
              acc /= (float)(p1 - p0);
              score[u] = acc > score[u] ? acc : score[u];
            }
          }
        }
        for (int64_t u = 0; u < n_units; ++u)
          if (u < a->init_units || u >= n_units - a->local_units) score[u] = INFINITY;
        m[h] = top_ascending(score, n_units, k, s->keys, s->sel + h * n_max);
      }
      return OK;
    }
    case KIND_INDEXER: {
      const int id = a->id;
      const int64_t pos = len - 1, bs = a->block_size;
      { /* this token's index key into the pool */
        int64_t dst = (blocks[pos / bs] * bs + pos % bs) * id;
        const float* kn = a->ik_new + n * id;
        for (int d = 0; d < id; ++d) {
          if (a->ik_bf16) ((uint16_t*)a->ik)[dst + d] = f32_to_bf16(kn[d]);
          else ((float*)a->ik)[dst + d] = kn[d];
        }
      }
      float* score = s->scores;
      if (len <= a->units) { /* every position */
        for (int64_t p = 0; p < len; ++p) s->sel[p] = (int32_t)p;
        m[0] = len;
      } else {
        const float* q = a->iq + n * (int64_t)a->ih * id;
        const float* w = a->iw + n * (int64_t)a->ih;
        const int ih = a->ih;
        f32x16 cols[KV_MAX_D]; /* a tile of 16 positions channel-major: a head's dots are a vector op a channel */
        for (int64_t p0 = 0; p0 < len; p0 += INDEX_TILE) {
          const int nt = (int)(len - p0 < INDEX_TILE ? len - p0 : INDEX_TILE);
          index_tile(a, blocks, p0, nt, cols);
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
            for (int j = 0; j < nh; ++j) { /* heads in order */
              const f32x16 relu = (f32x16)((u32x16)acc[j] & (u32x16)(acc[j] > (f32x16){0})); /* acc > 0 ? acc : 0 */
              out_t += w[h0 + j] * relu;
            }
          }
          memcpy(score + p0, &out_t, sizeof(float) * (size_t)nt);
        }
        m[0] = top_ascending(score, len, a->units, s->keys, s->sel);
      }
      for (int h = 1; h < hkv; ++h) {
        memcpy(s->sel + h * n_max, s->sel, sizeof(int32_t) * (size_t)m[0]);
        m[h] = m[0];
      }
      return OK;
    }
    default:
      return ERR_KIND;
  }
}

int kvsieve_decode_layer(const DecodeLayerArgs* a) {
  const int hkv = a->hkv, G = a->G, D = a->D;
  if (D < 1 || D > KV_MAX_D || G < 1 || G > KV_MAX_G || hkv < 1 || a->unit < 1 || a->units < 1 || a->block_size < 1)
    return ERR_SHAPE;
  if (!((a->k_ch == 1 && a->k_tok == D) || a->k_tok == 1)) return ERR_SHAPE; /* K rows of D, or by channel */
  if (a->kind == KIND_INDEXER && (a->id < 1 || a->id > KV_MAX_D || a->ih < 1 || a->ih > INDEX_MAX_H || a->unit != 1))
    return ERR_SHAPE;
  if ((a->kind == KIND_PAGES || a->kind == KIND_BLOCKS_BOUND)
      && (a->page_size < 1 || a->block_size % a->page_size || a->block_size / a->page_size != a->pool_sub
          || (a->kind == KIND_PAGES && a->unit != a->page_size) || (a->kind == KIND_BLOCKS_BOUND && a->unit % a->page_size)))
    return ERR_SHAPE;
  int64_t longest = 1;
  for (int64_t n = 0; n < a->n_rows; ++n) { /* every row's blocks inside its table and the cache */
    int64_t len = a->kv_lens[n], nb = (len + a->block_size - 1) / a->block_size;
    if (len < 1 || nb > a->table_width) return ERR_TABLE;
    for (int64_t j = 0; j < nb; ++j) {
      int32_t b = a->table[n * a->table_stride + j];
      if (b < 0 || b >= a->num_blocks) return ERR_TABLE;
    }
    longest = len > longest ? len : longest;
  }
  Scratch s;
  const int64_t n_max = longest + 2;
  s.max_runs = 2 * n_max + a->table_width + 4;
  s.scores = malloc(sizeof(float) * (size_t)(G + hkv + 1) * (size_t)n_max);
  s.keys = malloc(sizeof(uint64_t) * (size_t)n_max);
  s.sel = malloc(sizeof(int32_t) * (size_t)hkv * (size_t)n_max);
  s.ra = malloc(sizeof(int64_t) * (size_t)n_max);
  s.rb = malloc(sizeof(int64_t) * (size_t)n_max);
  s.k_off = malloc(sizeof(int64_t) * (size_t)s.max_runs);
  s.v_off = malloc(sizeof(int64_t) * (size_t)s.max_runs);
  s.cnt = malloc(sizeof(int32_t) * (size_t)s.max_runs);
  s.blocks = malloc(sizeof(int64_t) * (size_t)(a->table_width > 0 ? a->table_width : 1));
  s.keep = malloc(sizeof(int32_t) * (size_t)n_max);
  s.at = malloc(sizeof(int64_t) * (size_t)s.max_runs);
  s.kept = malloc(sizeof(int32_t) * (size_t)s.max_runs);
  float* qf = malloc(sizeof(float) * (size_t)hkv * G * D);
  int rc = OK;
  if (!s.scores || !s.keys || !s.sel || !s.ra || !s.rb || !s.k_off || !s.v_off || !s.cnt || !s.blocks || !s.keep
      || !s.at || !s.kept || !qf)
    rc = ERR_MEMORY;
  int64_t m[KV_MAX_G * 64];
  if (hkv > KV_MAX_G * 64) rc = ERR_SHAPE;
  const int64_t k_ch = a->k_ch == 1 ? 0 : a->k_ch; /* attend_dispatch: 0 = K rows of D */
  const int spans_aligned = a->block_size % SPAN_TILE == 0 && a->k_blk % SPAN_TILE == 0 && a->k_head % SPAN_TILE == 0
                            && k_ch % SPAN_TILE == 0; /* RunSpans.aligned: channel rows on the tile grid */
  for (int64_t n = 0; rc == OK && n < a->n_rows; ++n) {
    const int64_t len = a->kv_lens[n];
    for (int64_t j = 0; j * a->block_size < len; ++j) s.blocks[j] = a->table[n * a->table_stride + j];
    load_q(a, n, qf);
    int64_t n_stream = 0;
    if (a->kind == KIND_STREAMING) { /* [0, sink) and [recent, len), merged where they touch */
      int64_t sink = a->num_sink < len ? a->num_sink : len, recent = len - (a->units - a->num_sink);
      recent = recent > sink ? recent : sink;
      if (sink > 0) { s.ra[0] = 0; s.rb[0] = sink; n_stream = 1; }
      if (recent < len) {
        if (n_stream && s.rb[0] == recent) s.rb[0] = len;
        else { s.ra[n_stream] = recent; s.rb[n_stream] = len; ++n_stream; }
      }
    } else {
      rc = select_units(a, n, s.blocks, len, qf, &s, n_max, m);
      if (rc != OK) break;
    }
    for (int h = 0; h < hkv; ++h) {
      int64_t n_ranges = a->kind == KIND_STREAMING ? n_stream
                         : units_to_ranges(s.sel + h * n_max, m[h], a->unit, len, s.ra, s.rb);
      int64_t total = 0, runs = ranges_to_runs(a, s.blocks, h, s.ra, s.rb, n_ranges, &s, k_ch > 0, &total);
      if (runs < 0) { rc = ERR_MEMORY; break; }
      float o[KV_MAX_G * KV_MAX_D], lse[KV_MAX_G];
      const RunSpans spans = {s.keep, s.at, s.kept, spans_aligned};
      attend_dispatch(a->k, a->v, a->kv_bf16, s.k_off, s.v_off, s.cnt, runs, k_ch > 0, k_ch, &spans, D,
                      qf + (int64_t)h * G * D, G, a->sm_scale, o, lse);
      int64_t dst = n * a->out_stride + (int64_t)h * G * D;
      for (int64_t i = 0; i < (int64_t)G * D; ++i) {
        if (a->out_bf16) ((uint16_t*)a->out)[dst + i] = f32_to_bf16(o[i]);
        else ((float*)a->out)[dst + i] = o[i];
      }
      a->attended[n * hkv + h] = total;
    }
  }
  free(s.scores); free(s.keys); free(s.sel); free(s.ra); free(s.rb); free(s.k_off); free(s.v_off); free(s.cnt);
  free(s.blocks); free(s.keep); free(s.at); free(s.kept); free(qf);
  return rc;
}
